"""Vocab-parallel LCE (``process_group=``) against the unsharded op and the fp64 reference.

One job of 4 processes per module (gloo on CPU tensors, Triton's interpreter in every child), started once by the
``tp`` fixture: each rank runs the cases of its layouts (below) and saves what it got; the tests here compare.
Single options and call forms run on "2a" only; option combinations, label placements, frozen inputs, fp16 and the
errors run on all three (the module takes ~35 s on 2 cores).

* "2a": ranks 0, 1 of the job as a 2-rank group, vocab 100 split 37 / 63;
* "2b": ranks 2, 3 as another 2-rank group (group ranks != global ranks) at the same time, split 63 / 37;
* "4": all 4 ranks, split 25 / 0 / 50 / 25, an EMPTY shard on rank 1.

Under the interpreter's config (block_n=32) every shard has a vocab tail tile. Kept labels include ids on both
sides of every shard edge, so each label column lands on the right rank. While the children start, the parent
computes the unsharded op, the fp64 reference and (fp16) plain torch on the same inputs.

``test_vocab_parallel_nccl_two_gpus`` runs the same machinery with NCCL on 2 GPUs (marked gpu).
"""

from __future__ import annotations

import datetime
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

import test_lce as T  # noqa: N812 - the helpers of the unsharded tests
from hopperkern import lce, tma
from hopperkern.lce import distributed
from hopperkern.lce import reference as ref

ROOT = Path(__file__).resolve().parents[1]
SHAPE = (37, 100, 40)  # N, V, H, as in test_lce: a tail in every tiled dim
WORLD = 4
CPU_LAYOUTS = {"2a": ((0, 1), (37, 63)), "2b": ((2, 3), (63, 37)), "4": ((0, 1, 2, 3), (25, 0, 50, 25))}
# Ids on both sides of each shard edge of the layouts above, and 5 above the offsets 37, 63, 25, 75 (a shifted
# label equal to 5, the ignore_index of one case).
EDGE_LABELS = (36, 37, 62, 63, 24, 25, 74, 75, 42, 68, 30, 80)
CHILD_TIMEOUT_S = 300


@dataclass(frozen=True)
class TpCase:
    name: str
    why: str
    options: dict = field(default_factory=dict)  # keyword options of the function (and the reference)
    kind: str = "ce"  # "ce": linear_cross_entropy -> (loss,); "lpe": linear_logprobs_entropy -> (logprob, entropy)
    reduction: str = "mean"  # ce only
    bias: bool = False
    ignore: float = 0.0
    dtype: torch.dtype = torch.float32
    confident: tuple | None = None
    ups: tuple = (True, True)  # which outputs get an upstream gradient (ce: the first only)
    grad: bool = True  # False: the forward runs under torch.no_grad (the row-dot label logit)
    requires: tuple = (True, True, True)  # hidden, weight, bias
    # "edges": EDGE_LABELS among the kept labels; "high": all kept labels in [63, 100); "ignored": every token;
    # "bad": one label == V; "given": make_inputs' own (confident batches, whose hidden is built for their labels)
    labels: str = "edges"
    label_dtype: torch.dtype = torch.int64
    lead: tuple | None = None  # hidden [*lead, H] instead of [N, H]
    tma: str = "never"
    compiled: bool = False  # the function under torch.compile (backend "eager": dynamo only)
    kernel_only: dict = field(default_factory=dict)  # options the reference does not take (check_labels)
    shape: tuple = SHAPE
    # "N" (tokens) or "H" (hidden size) differ between ranks; "empty": every shard empty; "outsider": called with
    # the other pair's group, which this process is not in; "rank0_fails": group rank 0's local launch raises
    # (simulated: its lce_forward is replaced by one that raises what a refused TMA launch raises)
    skew: str | None = None
    error: tuple | None = None  # (exception type name, message pattern) that every rank must raise
    layouts: tuple = ("2a", "2b", "4")  # where it runs: options alone once, their combinations on every layout

    def make(self, device="cpu"):
        """Inputs and upstream gradients as a dict of tensors (saved for the children)."""
        ii = self.options.get("ignore_index", -100)
        inp = T.make_inputs(self.shape, self.dtype, bias=self.bias, ignore=self.ignore, ignore_index=ii,
                            confident=self.confident, softcap=self.options.get("softcap"),
                            temperature=self.options.get("temperature", 1.0), device=device)
        lab = inp.labels
        if self.labels == "edges":
            pos = torch.nonzero(inp.kept).flatten()[2:2 + len(EDGE_LABELS)]
            lab[pos] = torch.tensor(EDGE_LABELS[:len(pos)], dtype=lab.dtype, device=device)
        elif self.labels == "high":  # the first shard of every layout holds no label
            lab[inp.kept] = 63 + lab[inp.kept] % 37
        elif self.labels == "ignored":
            lab.fill_(ii)
        elif self.labels == "bad":
            lab[3] = self.shape[1]  # == V: outside every shard
        N = self.shape[0]
        per_token = self.kind == "lpe" or self.reduction == "none"
        ups = [T.upstream((N,) if per_token else (), seed=1 + i, device=device) if on else None
               for i, on in enumerate(self.ups[:2 if self.kind == "lpe" else 1])]
        lead = self.lead or (N,)
        return dict(hidden=inp.hidden.reshape(*lead, self.shape[2]), weight=inp.weight, bias=inp.bias,
                    labels=lab.to(self.label_dtype).reshape(lead), ups=[u if u is None else u.reshape(
                        lead if per_token else ()) for u in ups])

    def fn(self, impl, **extra):
        """``fn(hidden, weight, bias, labels)`` (test_lce.run's form) calling ``impl`` with this case's options."""
        opts = dict(self.options, **extra)
        if self.kind == "ce":
            opts["reduction"] = self.reduction
        return T.call(impl, **opts)

    def run(self, impl, data, weight=None, bias=None, dtype=None, **extra):
        """(outputs, grads) of ``impl`` on ``data`` (``weight``/``bias`` replace the full head: a shard)."""
        inp = T.Inputs(data["hidden"], data["weight"] if weight is None else weight,
                       data["bias"] if bias is None else bias, data["labels"],
                       self.options.get("ignore_index", -100))
        ctx = None if self.grad else torch.no_grad()
        return T.run(self.fn(impl, **extra), inp, data["ups"] if self.grad else [], dtype=dtype,
                     requires=self.requires, forward_ctx=ctx)

    @property
    def functions(self):
        """(kernel function, fp64 reference, plain torch in the inputs' dtype) of this case's kind."""
        if self.kind == "ce":
            return lce.linear_cross_entropy, ref.linear_cross_entropy, T.torch_lowp_cross_entropy
        return lce.linear_logprobs_entropy, ref.linear_logprobs_entropy, T.torch_lowp_logprobs_entropy


ALL = T.ALL  # label smoothing, z-loss, softcap, temperature
ONCE = ("2a",)  # a single option or call form: one layout is enough
CASES = [
    TpCase("plain", "no options: the sharded lse, label logit and d_hidden sum"),
    TpCase("bias/sum", "bias shards; d_bias local to each shard", bias=True, reduction="sum", tma="always",
           layouts=ONCE),
    TpCase("label_smoothing", "eps / V over the GLOBAL V, forward (sum z across ranks) and backward",
           dict(label_smoothing=0.1)),
    TpCase("z_loss/none", "z_loss * lse^2 on the global lse, per-token upstream grads", dict(z_loss=0.02),
           reduction="none", tma="always", layouts=ONCE),
    TpCase("softcap", "softcap on each shard's logits and the (1 - tanh^2) factor at the label's rank",
           dict(softcap=3.0), layouts=ONCE),
    TpCase("temperature/sum", "1/T on every shard", dict(temperature=0.7), reduction="sum", tma="always",
           layouts=ONCE),
    TpCase("ignore_index=5/none", "ignore_index inside [0, V_r): a shifted label equal to 5 stays a label",
           dict(ignore_index=5), ignore=0.3, reduction="none"),
    TpCase("all/none", "every option + bias + ignored tokens, per-token upstream grads", ALL, bias=True,
           ignore=0.3, reduction="none", tma="always"),
    TpCase("all/mean", "mean over the kept tokens (the same count on every rank)", ALL, bias=True, ignore=0.3),
    TpCase("all/sum", "every option, sum", ALL, bias=True, ignore=0.3, reduction="sum", tma="always"),
    TpCase("no label on shard 0", "every label in [63, 100): the first shard of each layout holds none", ALL,
           bias=True, ignore=0.3, labels="high"),
    TpCase("3-D int32", "hidden [1, 37, H], int32 labels [1, 37]", dict(label_smoothing=0.1), reduction="none",
           ignore=0.3, label_dtype=torch.int32, lead=(1, 37), layouts=ONCE),
    TpCase("frozen weight", "only d_hidden: its all-reduce without weight grads", ALL, bias=True, ignore=0.3,
           requires=(True, False, False), tma="always"),
    TpCase("frozen hidden", "only d_weight and d_bias: no d_hidden all-reduce", ALL, bias=True, ignore=0.3,
           requires=(False, True, True)),
    TpCase("no tokens", "N = 0 on every rank: empty outputs, zero grads, no collective but the size gather",
           dict(label_smoothing=0.1), bias=True, shape=(0, 100, 40)),
    TpCase("all ignored", "mean of no kept token is 0.0 with zero grads on every rank", dict(z_loss=0.02),
           bias=True, labels="ignored"),
    TpCase("no grad", "forward under no_grad: the label logit from the row-dot kernel on the holding rank", ALL,
           bias=True, ignore=0.3, reduction="none", grad=False, tma="always"),
    TpCase("unchecked bad label", "check_labels=False, a label == V: NaN at that token, as unsharded",
           dict(z_loss=0.02), reduction="none", labels="bad", grad=False, kernel_only=dict(check_labels=False),
           layouts=ONCE),
    TpCase("lpe/both", "log-probs and entropies with per-token upstream grads on both",
           dict(temperature=0.7), kind="lpe", ignore=0.3),
    TpCase("lpe/entropy only", "only the entropy's gradient (flows through ignored tokens too)",
           dict(temperature=0.7), kind="lpe", ignore=0.3, ups=(False, True), tma="always", layouts=ONCE),
    TpCase("lpe/compiled", "under torch.compile the sharded path runs eagerly, with its autograd",
           dict(temperature=0.7), kind="lpe", ignore=0.3, compiled=True, layouts=ONCE),
    TpCase("lpe/no grad", "the no-grad log-prob / entropy pass of RL", dict(temperature=0.7), kind="lpe", ignore=0.3,
           grad=False, layouts=ONCE),
    TpCase("fp16/plain", "fp16 shards: within 2x plain torch's fp16 error", dtype=torch.float16, layouts=ONCE),
    TpCase("fp16/all/none", "fp16 with every option", ALL, bias=True, ignore=0.3, reduction="none",
           dtype=torch.float16, tma="always"),
    TpCase("fp16/confident/all", "p_label in [0.99, 0.9999]: p - 1 at the label, formed on the label's rank from "
           "the global log-prob, rounded once", T.CONFIDENT_ALL, bias=True, ignore=0.2, reduction="none",
           dtype=torch.float16, confident=T.CONFIDENT, labels="given"),
    TpCase("fp16/lpe/confident", "confident RL batch: log-prob gradient g (1 - p) at the label",
           dict(temperature=0.7), kind="lpe", ignore=0.2, dtype=torch.float16, confident=T.CONFIDENT, labels="given"),
]
ERRORS = [
    TpCase("label == V", "labels are checked against the global V (not the shard's)", labels="bad",
           error=("ValueError", r"labels must be in \[0, 100\) or ignore_index=-100; got \[100\]")),
    TpCase("N differs", "ranks with different token counts", skew="N", error=(
        "ValueError", r"hidden must have the same number of tokens N on every rank of process_group, got N = \[")),
    TpCase("H differs", "ranks with different hidden sizes", skew="H", error=(
        "ValueError", r"weight must have the same hidden size H on every rank of process_group, got H = \[")),
    TpCase("every shard empty", "V = 0 over the group", skew="empty", error=(
        "ValueError", r"weight must have V >= 1 rows on some rank of process_group, got V = \[0, 0")),
    TpCase("not in the group", "what new_group gives a process outside the group (torch's NON_GROUP_MEMBER, an "
           "int), passed on", skew="outsider", layouts=("2a", "2b"), error=(
               "TypeError", r"process_group must be a torch.distributed.ProcessGroup or None, got int")),
]

# Errors raised by one rank only: that rank raises its own error, every other rank of the group a RuntimeError
# saying so, instead of waiting in the next collective.
ONE_RANK_FAILS = [
    TpCase("one rank fails", "group rank 0's local forward raises (e.g. tma='always' refused for its shard alone); "
           "the others, an empty shard among them, stop too", skew="rank0_fails",
           error=("UnsupportedError", r"tma='always' was asked for, but TMA cannot be used")),
]

# ---------------------------------------------------------------------------------------------------------------
# The children


def _shard_rows(split, group_rank):
    off = sum(split[:group_rank])
    return slice(off, off + split[group_rank])


def _one(case: TpCase, data, group, split, rank_in_group, other_group):
    """What this rank got for ``case``: outputs, grads, the forward's memory path and its ``pick_label`` flags, or
    the error it raised."""
    rows = _shard_rows(split if case.skew != "empty" else (0,) * len(split), rank_in_group)
    data = dict(data)
    if case.skew == "N":
        data["hidden"], data["labels"] = data["hidden"][rank_in_group:], data["labels"][rank_in_group:]
    if case.skew == "H":
        data["hidden"], data["weight"] = data["hidden"][:, rank_in_group:], data["weight"][:, rank_in_group:]
    if case.skew == "outsider":
        group = other_group
    weight = data["weight"][rows]
    impl = torch.compile(case.functions[0], backend="eager") if case.compiled else case.functions[0]
    before, picks, real = tma.decision_count(T.FWD), [], distributed.lce_forward
    distributed.lce_forward = lambda *a, **k: picks.append(k["pick_label"]) or real(*a, **k)
    if case.skew == "rank0_fails" and rank_in_group == 0:
        def refused(*a, **k):
            raise tma.UnsupportedError("lce.forward: tma='always' was asked for, but TMA cannot be used",
                                       ["weight: stride(0)=164 bytes is not a multiple of 16"])

        distributed.lce_forward = refused
    try:
        outs, grads = case.run(impl, data, weight=weight,
                               bias=None if data["bias"] is None else data["bias"][rows], tma=case.tma,
                               process_group=group, **case.kernel_only)
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which checks it
        return dict(error=(type(exc).__name__, str(exc)))
    finally:
        distributed.lce_forward = real
    d = tma.last_decision(T.FWD)
    path = None if tma.decision_count(T.FWD) == before else (d.mode, dict(d.use))
    return dict(error=None, outs=outs, grads=grads, path=path, picks=picks)


def _worker(rank: int, world: int, workdir: str, backend: str) -> None:
    import torch.distributed as dist

    device = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{workdir}/rendezvous", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=CHILD_TIMEOUT_S // 2))
    layouts = _layouts(backend)
    # Every rank creates every group, in the same order (torch.distributed's rule).
    groups = {name: dist.new_group(list(ranks)) for name, (ranks, _) in layouts.items()}
    inputs = torch.load(Path(workdir) / "inputs.pt")
    cases = _cases(backend)
    results = {}
    for name, (ranks, split) in layouts.items():
        if rank not in ranks:
            continue
        for case in (c for c in cases if name in c.layouts):
            other = next((g for n, g in groups.items() if rank not in layouts[n][0]), None)
            got = _one(case, _to(inputs[case.name], device), groups[name], split, ranks.index(rank), other)
            results[(case.name, name)] = _to(got, "cpu")
    torch.save(results, Path(workdir) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def _to(x, device):
    """``x`` with every tensor inside (dicts, lists, tuples) moved to ``device``."""
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, dict):
        return {k: _to(v, device) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_to(v, device) for v in x)
    return x


# ---------------------------------------------------------------------------------------------------------------
# The parent


@dataclass
class TpRun:
    inputs: dict  # case name -> inputs
    expected: dict  # case name -> {"op": (outs, grads), "ref": ..., "base": ...}
    results: list  # per rank: {(case name, layout): what _one returned}
    layouts: dict


def _expected(case: TpCase, data, device):
    """The unsharded op's (outputs, grads), the fp64 reference's and (16-bit inputs) plain torch's, on the CPU."""
    data = _to(data, device)
    kernel, reference, plain = case.functions
    out = {"op": case.run(kernel, data, tma=case.tma, **case.kernel_only),
           "ref": case.run(reference, data, dtype=torch.float64) if case.labels != "bad" else None}
    if case.dtype != torch.float32:
        out["base"] = case.run(plain, data)
    return _to(out, "cpu")


def launch_job(backend: str, world: int, device) -> TpRun:
    """Start ``world`` children on ``backend``, compute the expectations here meanwhile, collect what they saved."""
    cases = _cases(backend)
    inputs = {c.name: c.make() for c in cases}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("HOPPERKERN_TMA", None)  # it would override the modes the cases ask for
    if backend == "gloo":
        env["TRITON_INTERPRET"] = "1"  # in the child's environment before it imports triton
    with tempfile.TemporaryDirectory(prefix="lce_tp_") as workdir:
        work = Path(workdir)
        torch.save(inputs, work / "inputs.pt")
        logs = [open(work / f"rank{r}.log", "w") for r in range(world)]  # files: a full pipe cannot block a child
        procs = [subprocess.Popen([sys.executable, __file__, "worker", str(r), str(world), workdir, backend],
                                  cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
                 for r, log in enumerate(logs)]
        try:
            expected = {c.name: _expected(c, inputs[c.name], device) for c in cases if c.error is None}
            deadline = time.monotonic() + CHILD_TIMEOUT_S
            for p in procs:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass  # reported below with the children's logs
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            for log in logs:
                log.close()
        failed = [r for r, p in enumerate(procs) if p.returncode != 0]
        if failed:
            pytest.fail("vocab-parallel children failed or hung:\n" + "\n".join(
                f"--- rank {r} (exit {procs[r].returncode}):\n{(work / f'rank{r}.log').read_text()[-4000:]}"
                for r in failed))
        results = [torch.load(work / f"rank{r}.pt") for r in range(world)]
    return TpRun(inputs, expected, results, _layouts(backend))


@pytest.fixture(scope="module")
def tp():
    return launch_job("gloo", WORLD, "cpu")


def _gathered(run: TpRun, case: TpCase, layout: str):
    """Per-rank results of ``case`` on ``layout``: no rank may have raised."""
    ranks, _ = run.layouts[layout]
    got = [run.results[r][(case.name, layout)] for r in ranks]
    for r, g in zip(ranks, got):
        assert g["error"] is None, f"rank {r} raised {g['error']}"
    return ranks, got


def _same_on_every_rank(what, tensors):
    for r, t in enumerate(tensors[1:], 1):
        torch.testing.assert_close(t, tensors[0], rtol=0, atol=0, equal_nan=True,
                                   msg=lambda m: f"{what} on group rank {r} != rank 0's: {m}")


def check_layout(run: TpRun, case: TpCase, layout: str, fp32_rtol=T.FP32_RTOL):
    ranks, got = _gathered(run, case, layout)
    _, split = run.layouts[layout]
    outs = got[0]["outs"]
    for i in range(len(outs)):
        _same_on_every_rank(f"output {i}", [g["outs"][i] for g in got])
    dh = got[0]["grads"][0]
    if dh is not None:
        _same_on_every_rank("d_hidden", [g["grads"][0] for g in got])
    cat = [None if got[0]["grads"][k] is None else torch.cat([g["grads"][k] for g in got]) for k in (1, 2)]
    for g, size in zip(got, split):
        if g["grads"][1] is not None:
            assert g["grads"][1].shape[0] == size, "d_weight must have the shard's rows"
    grads = [dh] + cat
    for r, g, size in zip(ranks, got, split):
        launched = size > 0 and case.shape[0] > 0  # an empty shard or no tokens: no kernel
        want_path = (case.tma, T.expected_use(case.tma)[T.FWD])
        assert g["path"] == (want_path if launched else None), f"rank {r}: forward path {g['path']}"
        # The label's logit from the forward's tiles exactly when a backward follows (p - 1 at full precision).
        assert g["picks"] == ([case.grad] if launched else []), f"rank {r}: pick_label {g['picks']}"
    op_outs, op_grads = run.expected[case.name]["op"]
    if case.labels == "bad":  # NaN exactly where the unsharded op has it, equal elsewhere
        torch.testing.assert_close(outs[0], op_outs[0], rtol=fp32_rtol, atol=fp32_rtol, equal_nan=True)
        assert outs[0].isnan().sum() == 1
        return
    ref_outs, ref_grads = run.expected[case.name]["ref"]
    if case.dtype == torch.float32:
        for what, (want_outs, want_grads) in (("unsharded op", (op_outs, op_grads)), ("fp64", (ref_outs, ref_grads))):
            for i, (o, w) in enumerate(zip(outs, want_outs)):
                assert o.dtype == torch.float32 and o.shape == w.shape, f"output {i}"
                T.assert_close(o, w, fp32_rtol, f"output {i} vs {what}")
            T.check_grads(grads, want_grads, fp32_rtol)
    else:
        base_outs, base_grads = run.expected[case.name]["base"]
        names = ("loss",) if case.kind == "ce" else ("logprob", "entropy")
        atol = T.CONFIDENT_LOSS_ATOL if case.confident else 1e-5
        for name, o, b, w in zip(names, outs, base_outs, ref_outs):
            T.assert_no_worse(name, o, b, w, atol=atol)
        for name, g, b, w in zip(("d_hidden", "d_weight", "d_bias"), grads, base_grads, ref_grads):
            assert (g is None) == (w is None), name
            if w is not None:
                assert g.dtype == case.dtype, name
                T.assert_no_worse(name, g, b, w)


def _where(cases):
    return [pytest.param(c, layout, id=f"{c.name}-{layout}") for c in cases for layout in c.layouts]


@pytest.mark.parametrize("case, layout", _where(CASES))
def test_vocab_parallel_matches_unsharded(case, layout, tp):
    """Every rank gets the unsharded op's outputs and d_hidden, the shards' d_weight/d_bias concatenate to its
    d_weight/d_bias (fp32: to 1e-5 of the op and of fp64; fp16: within 2x plain torch's error of fp64), and the
    forward ran on the case's memory path on every non-empty shard."""
    check_layout(tp, case, layout)


def test_cases_reach_what_they_claim(tp):
    """The inputs do what the case list says: every edge label present, the first shard of each layout without a
    label, and both ignored tokens (label 5) and a label 5 above a shard's offset."""
    lab = tp.inputs["plain"]["labels"]
    assert set(EDGE_LABELS) <= set(lab.tolist())
    high = tp.inputs["no label on shard 0"]["labels"]
    assert ((high >= 63) | (high == -100)).all()
    lab5 = tp.inputs["ignore_index=5/none"]["labels"]
    assert (lab5 == 5).any() and (lab5 == 42).any(), "ignore_index=5 and label 37 + 5 both present"


@pytest.mark.parametrize("case, layout", _where(ERRORS))
def test_vocab_parallel_errors(case, layout, tp):
    """Every rank of the group raises the same documented error (none waits in a collective)."""
    ranks, _ = tp.layouts[layout]
    errs = [tp.results[r][(case.name, layout)]["error"] for r in ranks]
    typ, pattern = case.error
    for r, e in zip(ranks, errs):
        assert e is not None and e[0] == typ and re.search(pattern, e[1]), f"rank {r}: {e}"
    assert len({e[1] for e in errs}) == 1, errs


@pytest.mark.parametrize("case, layout", _where(ONE_RANK_FAILS))
def test_one_rank_failing_stops_the_group(case, layout, tp):
    """A launch refused on one rank only: that rank raises its error, the others a RuntimeError that says another
    rank failed (the job finishing at all shows that no rank waited in a collective)."""
    ranks, _ = tp.layouts[layout]
    errs = [tp.results[r][(case.name, layout)]["error"] for r in ranks]
    typ, pattern = case.error
    assert errs[0] is not None and errs[0][0] == typ and re.search(pattern, errs[0][1]), errs[0]
    for r, e in zip(ranks[1:], errs[1:]):
        assert e is not None and e[0] == "RuntimeError" and "another rank of the group failed" in e[1], f"rank {r}: {e}"


@pytest.mark.parametrize("fn", [lce.linear_cross_entropy, lce.linear_logprobs_entropy])
def test_process_group_must_be_a_process_group(fn):
    inp = T.make_inputs(T.SMALL)
    with pytest.raises(TypeError, match="process_group must be a torch.distributed.ProcessGroup or None, got str"):
        fn(inp.hidden, inp.weight, inp.labels, process_group="world")


def test_empty_shard_needs_a_group():
    """Without a group an empty weight is still an error."""
    inp = T.make_inputs(T.SMALL)
    with pytest.raises(ValueError, match=r"weight must have V >= 1 rows and H >= 1 columns, got shape \(0, 40\)"):
        lce.linear_cross_entropy(inp.hidden, inp.weight[:0], inp.labels)


# ---------------------------------------------------------------------------------------------------------------
# Two GPUs, NCCL

GPU_SHAPE = (1000, 32003, 512)  # N, V, H: uneven shards of a real-ish vocab tail
GPU_LAYOUTS = {"2": ((0, 1), (12000, 20003))}
GPU_CASES = [
    TpCase("gpu/fp32/all", "fp32 with every option", ALL, bias=True, ignore=0.3, shape=GPU_SHAPE, tma="always",
           labels="given"),
    TpCase("gpu/bf16/all/none", "bf16 with every option", ALL, bias=True, ignore=0.3, reduction="none",
           dtype=torch.bfloat16, shape=GPU_SHAPE, tma="always", labels="given"),
    TpCase("gpu/bf16/lpe", "bf16 RL log-probs and entropies", dict(temperature=0.7), kind="lpe", ignore=0.3,
           dtype=torch.bfloat16, shape=GPU_SHAPE, tma="always", labels="given"),
    TpCase("gpu/bf16/no grad", "bf16 no-grad log-probs", dict(temperature=0.7), kind="lpe", ignore=0.3,
           dtype=torch.bfloat16, shape=GPU_SHAPE, tma="always", labels="given", grad=False),
]


def _layouts(backend):
    return GPU_LAYOUTS if backend == "nccl" else CPU_LAYOUTS


def _cases(backend):
    return GPU_CASES if backend == "nccl" else CASES + ERRORS + ONE_RANK_FAILS


@pytest.mark.gpu
def test_vocab_parallel_nccl_two_gpus():
    """2 processes, NCCL, one GPU each: the same comparisons as on CPU at a larger, unevenly split vocab, bf16
    included; fp32 to 1e-4 (at H=512 and V=32003 the fp32 sums of the op itself are ~1e-5 from fp64)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    run = launch_job("nccl", 2, "cuda:0")
    for case in GPU_CASES:
        check_layout(run, case, "2", fp32_rtol=1e-4)


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    _worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
