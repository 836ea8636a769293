"""A Hugging Face transformers model converted with tpfp8.swap_linear: FP8 training,
save_pretrained / from_pretrained with its FP8 state, torch.save with weights_only, and
gradient checkpointing as transformers turns it on (plain torch.utils.checkpoint). Tiny Llama
configs on the CPU; skipped where transformers is not installed."""
import io

import pytest
import torch

import tpfp8

transformers = pytest.importorskip("transformers", reason="transformers not installed")


def tiny_llama(seed=0):
    """A 2-layer Llama whose Linears all have FP8-friendly sizes (multiples of 16)."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config)


def train(model, steps, recipe, seed=1):
    """`steps` SGD steps of next-token loss inside fp8_autocast; the losses."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, 64, (2, 32), generator=gen)
        with tpfp8.fp8_autocast(recipe=recipe):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def fp8_layers(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, tpfp8.Linear)}


def assert_same_state(a, b):
    la, lb = fp8_layers(a), fp8_layers(b)
    assert la.keys() == lb.keys() and la
    for name in la:
        sa, sb = la[name].fp8_state, lb[name].fp8_state
        if sa is None or sb is None:  # (no delayed-scaling state: current scaling)
            assert sa is sb, name
            continue
        assert sa["recipe"] == sb["recipe"], name
        for d in ("forward", "backward"):
            for k in ("scale", "scale_inv", "amax_history"):
                assert torch.equal(sa[d][k], sb[d][k]), f"{name} {d} {k}"
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        if not na.endswith("_extra_state"):
            assert na == nb and torch.equal(pa, pb), na


def test_save_pretrained_round_trip_keeps_fp8_state_and_weights(tmp_path):
    recipe = tpfp8.DelayedScaling(amax_history_len=8)
    model = tpfp8.swap_linear(tiny_llama())
    train(model, 3, recipe)
    model.save_pretrained(tmp_path)
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    tpfp8.swap_linear(loaded)
    assert tpfp8.load_fp8_state(loaded, tmp_path) == len(fp8_layers(model))
    assert_same_state(model, loaded)
    # Both go on alike: the same next step from the same state.
    assert train(model, 1, recipe, seed=7) == train(loaded, 1, recipe, seed=7)


def test_save_pretrained_before_any_fp8_step(tmp_path):
    model = tpfp8.swap_linear(tiny_llama())
    model.save_pretrained(tmp_path)  # (the FP8 state is an empty tensor: nothing to keep)
    loaded = tpfp8.swap_linear(transformers.LlamaForCausalLM.from_pretrained(tmp_path))
    assert tpfp8.load_fp8_state(loaded, tmp_path) == 0
    assert all(m.fp8_state is None for m in fp8_layers(loaded).values())


def test_torch_save_weights_only_and_plain_checkpoint():
    recipe = tpfp8.DelayedScaling(amax_history_len=8)
    model = tpfp8.swap_linear(tiny_llama())
    train(model, 2, recipe)
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    other = tpfp8.swap_linear(tiny_llama(seed=3))
    other.load_state_dict(torch.load(buf, weights_only=True))
    assert_same_state(model, other)
    plain = tiny_llama(seed=4)  # a checkpoint of the unconverted model loads too
    other.load_state_dict(plain.state_dict())
    assert torch.equal(other.model.layers[0].mlp.up_proj.weight,
                       plain.model.layers[0].mlp.up_proj.weight)


@pytest.mark.parametrize("use_reentrant", [True, False])
@pytest.mark.parametrize("recipe", [tpfp8.DelayedScaling(amax_history_len=8),
                                    tpfp8.CurrentScaling()], ids=["delayed", "current"])
def test_gradient_checkpointing_enable_matches_plain_training(recipe, use_reentrant):
    plain = tpfp8.swap_linear(tiny_llama(seed=5))
    ckpt = tpfp8.swap_linear(tiny_llama(seed=5))
    # (transformers 5 renamed gradient_checkpointing_enable; both call torch's checkpoint)
    enable = getattr(ckpt, "activation_checkpointing_enable", None)
    if enable is None:
        ckpt.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    else:
        enable(activation_checkpointing_kwargs={"use_reentrant": use_reentrant})
    ckpt.train()
    recomputes = []  # forwards of a layer run by backward: the checkpoint's recompute
    layer = ckpt.model.layers[0].mlp.down_proj
    # (a pre-hook: a non-reentrant recompute stops right after the last saving op)
    layer.register_forward_pre_hook(
        lambda *_: recomputes.append(torch._C._current_graph_task_id() != -1))
    got = train(ckpt, 3, recipe)
    assert recomputes.count(True) == 3 and recomputes.count(False) == 3
    assert train(plain, 3, recipe) == got
    assert train(plain, 3, recipe) == train(ckpt, 3, recipe)
    assert_same_state(plain, ckpt)


def test_load_fp8_state_reads_the_index_of_a_sharded_save_and_warns_on_other_names(tmp_path):
    """A sharded save_pretrained: the state comes from the shards its index names (a stale
    shard left in the folder is not read). Loading into a model whose layers are named
    otherwise (wrapped by PEFT, say) loads nothing and says why."""
    recipe = tpfp8.DelayedScaling(amax_history_len=8)
    model = tpfp8.swap_linear(tiny_llama())
    train(model, 2, recipe)
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    stale = tpfp8.swap_linear(tiny_llama(seed=5))
    train(stale, 1, tpfp8.DelayedScaling(amax_history_len=4))
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in stale.state_dict().items()
               if k.endswith("_extra_state")}, tmp_path / "old.safetensors")
    loaded = tpfp8.swap_linear(transformers.LlamaForCausalLM.from_pretrained(tmp_path))
    assert tpfp8.load_fp8_state(loaded, tmp_path) == len(fp8_layers(model))
    assert_same_state(model, loaded)

    wrapped = torch.nn.ModuleDict({"base": tpfp8.swap_linear(tiny_llama(seed=6))})
    with pytest.warns(UserWarning, match="match no tpfp8.Linear"):
        assert tpfp8.load_fp8_state(wrapped, tmp_path) == 0
