"""Tensor-parallel helpers: the group's shape, sequence splitting, and shard bookkeeping.

Sequence parallelism splits activations along dim 0 (the sequence, for Megatron's
[sequence, batch, hidden] layout): rank r holds rows r*S/tp .. (r+1)*S/tp.
"""
from typing import Optional

import torch
import torch.distributed as dist


def group_size(group) -> int:
    """Ranks in `group` (1 for None: no tensor parallelism)."""
    return dist.get_world_size(group) if group is not None else 1


def group_rank(group) -> int:
    """This process's rank within `group` (0 for None)."""
    return dist.get_rank(group) if group is not None else 0


def check_divisible(value: int, group, what: str, fix: str) -> None:
    """Raises ValueError (what, the group size, how to fix) unless the group divides value."""
    tp = group_size(group)
    if value % tp:
        raise ValueError(f"{what}={value} is not divisible by the tensor-parallel group size "
                         f"{tp}; {fix}")


def split_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's part of `x` along dim 0 (a contiguous copy)."""
    check_divisible(x.shape[0], group, "sequence length (dim 0)", "pad the sequence")
    return x.chunk(group_size(group), dim=0)[group_rank(group)].contiguous()


def is_non_member(value) -> bool:
    """Whether `value` is what ``dist.new_group`` gives the ranks outside the group."""
    return type(value) is int and value == dist.GroupMember.NON_GROUP_MEMBER


def check_group(group, what: str = "tp_group") -> None:
    """TypeError unless `group` is a process group; ValueError if this rank is not in it."""
    if not isinstance(group, dist.ProcessGroup):
        if is_non_member(group):
            raise ValueError(f"{what}: this rank (global rank {dist.get_rank()}) is not in the "
                             f"group; every rank that builds or runs the layer must be in it")
        raise TypeError(f"{what} must be a torch.distributed ProcessGroup (e.g. "
                        f"dist.new_group(ranks)), got {type(group).__name__}")


def gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """All ranks' parts of a sequence-split tensor, concatenated along dim 0 (no autograd);
    `x` itself for None (no tensor parallelism), as ``split_sequence``."""
    if group is None:
        return x
    out = torch.empty((x.shape[0] * group_size(group),) + tuple(x.shape[1:]), dtype=x.dtype,
                      device=x.device)
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out


def shard(full: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's slice of `full` along `dim`."""
    return full.chunk(group_size(group), dim=dim)[group_rank(group)].contiguous()


def unshard(local: torch.Tensor, dim: int, group) -> torch.Tensor:
    """The full tensor from every rank's slice along `dim` (`local` itself for None)."""
    if group is None:
        return local
    parts = [torch.empty_like(local) for _ in range(group_size(group))]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def contains(outer, inner) -> bool:
    """Whether every rank of process group `inner` is in `outer` (None: the default group)."""
    def ranks(g):
        return set(dist.get_process_group_ranks(g if g is not None else dist.group.WORLD))
    return ranks(inner) <= ranks(outer)


def amax_group_for(module_group, sequence_parallel: bool, requested: Optional[object]):
    """The group a module's delayed-scaling amaxes are reduced over: the one fp8_autocast was
    given (it must contain the tensor-parallel group, else the gathered FP8 bytes of ranks
    would carry different scales), or the tensor-parallel group under sequence parallelism.
    A group this rank is not in is refused: the exit's reduction could not include it."""
    if requested is not None:
        check_group(requested, "fp8_autocast(amax_group=...)")
        if module_group is not None and not contains(requested, module_group):
            raise ValueError("fp8_autocast(amax_group=...) must contain the layer's tp_group: "
                             "ranks that gather FP8 data from each other need one scale")
        return requested
    return module_group if sequence_parallel else None
