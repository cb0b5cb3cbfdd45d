"""predict's suggestions for a number of ranks: the layouts of that many GPUs it can compute for the model.

    layouts_for(llama3-8b, 4096, 4)  ->  'layouts of 4 ranks predict computes for this model: --tp 4;
        --cp 4 --attention fused; --tp 2 --cp 2 --attention fused; --zero 3 --dp 4 (the model state sharded, ...)'

A layout is listed only where predict computes it for this shape: --tp t where t divides the heads
(Korthikanti's rows), --cp c where context parallelism takes the model (a dense MLP, no dropout, the sequence
cut into 2c zigzag chunks; --attention fused added when the model's is eager), --tp t --cp c where a
tensor-parallel rank also splits t x (its T/c tokens), ZeRO over the ranks (it shards the model state, not the
activations), and, for a mixture of experts, expert parallelism (measured by `parallel --ep`, not predicted).
When nothing splits the activations the text says so and why, never an empty list.
"""
from ..parallel.tensor_parallel.tp_shard import check_tensor_parallel


def cp_refusal(cfg, seq, cp):
    """Why predict's --cp cannot take `cp` ranks of this model (its attention apart: --attention changes it),
    in words naming the flag; None when it can."""
    if cfg.experts:
        return f"--cp {cp} needs a dense MLP, and this model has {cfg.experts} experts (--experts)"
    if cfg.dropout:
        return f"--cp {cp} needs --dropout 0 (the masks of blocks spread over ranks are not the single process's)"
    if seq % (2 * cp):
        return f"--cp {cp} needs --seq a multiple of 2 x {cp} = {2 * cp} (zigzag: a front and a back chunk per rank)"
    return None


def cp_fits(cfg, seq, cp):
    return cp >= 2 and cp_refusal(cfg, seq, cp) is None


def tp_fits(cfg, seq, tp, sp=False):
    """Whether a tensor-parallel rank of `tp` splits this model on `seq` tokens (picockpt's per-rank forms)."""
    try:
        check_tensor_parallel(cfg, tp, sp, seq)
    except ValueError:
        return False
    return True


def layouts_for(cfg, seq, ranks, sp=False):
    """One clause naming the layouts of `ranks` ranks predict computes for `cfg` at `seq` tokens (with --sp: the
    tp x cp ones that take it), or saying why none splits the activations (with ZeRO's, which fits ranks >= 2)."""
    if not isinstance(ranks, int) or ranks < 2:
        return "one rank needs no layout: leave --tp, --cp and --dp out"
    attention = "" if cfg.attention != "eager" else " --attention fused"
    dense = " (Korthikanti's dense rows: these forms do not split experts over tp)" if cfg.experts else ""
    tp_splits = cfg.heads % ranks == 0 if cfg.experts else tp_fits(cfg, seq, ranks, sp)  # experts: the dense rows
    found = [f"--tp {ranks}{dense}"] if tp_splits else []
    found += [f"--cp {ranks}{attention}"] if cp_fits(cfg, seq, ranks) else []
    found += [f"--tp {t} --cp {ranks // t}{attention}" for t in range(2, ranks // 2 + 1)
              if ranks % t == 0 and cp_fits(cfg, seq, ranks // t) and tp_fits(cfg, seq // (ranks // t), t, sp)]
    ep = (f"; expert parallelism over {ranks} ranks ({cfg.experts // ranks} of the {cfg.experts} experts each) is "
          f"measured by `python -m picockpt parallel --ep {ranks}` on a small shape, not predicted here"
          if cfg.experts and cfg.experts % ranks == 0 else "")
    zero = f"--zero 3 --dp {ranks} (the model state sharded, the activations whole)"
    if found:
        return f"layouts of {ranks} ranks predict computes for this model: {'; '.join(found)}; {zero}{ep}"
    why = f"--tp {ranks} needs {ranks} to divide the {cfg.heads} heads; {cp_refusal(cfg, seq, ranks)}"
    return (f"no layout of {ranks} ranks splits this model's activations ({why}; no tp x cp product of {ranks} fits "
            f"either); {zero} fits{ep}")
