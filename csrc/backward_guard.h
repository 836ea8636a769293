// A Linear forward op that runs inside a backward pass is an activation checkpoint's recompute,
// correct only where the module's Python matched it to the forward it repeats and passed that
// forward's recipe and scales. A compiled graph's forward re-run by an eager checkpoint runs no
// Python, so it would recompute with whatever it was traced with: refused. The module marks, on
// this thread, the calls it vetted. Allowed unvetted: a compiled backward's recompute of a call
// that records no amax (torch.compile of a model with checkpoints in it traced it with the
// forward; a call that records one is never recomputed there, as it mutates state).
#pragma once

namespace tpfp8 {

void set_forward_vetted(bool vetted);
void check_forward_outside_backward_or_vetted(bool records_amax);

}  // namespace tpfp8
