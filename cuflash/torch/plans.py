"""The plan recorder: which kernels each distinct attention shape ran (off unless
:func:`record_plans` is active)."""
import contextlib
import threading
from typing import Callable, NamedTuple, Optional

import cuflash


class PlanRecord(NamedTuple):
    """One distinct attention call seen while recording: ``plan`` is a :class:`cuflash.plan`
    result (None for varlen calls, which it does not describe)."""
    phase: str                  # "prefill" (seqlen_q > 1), "decode" (seqlen_q == 1) or "varlen"
    q_shape: tuple
    k_shape: tuple
    causal: bool
    plan: object

    @property
    def kernels(self) -> tuple:
        return tuple(self.plan.kernels) if self.plan is not None else ()

    @property
    def num_splits(self) -> int:
        return int(self.plan.num_splits) if self.plan is not None else 1

    def __str__(self):
        what = " + ".join(self.kernels) if self.plan is not None else "(varlen: no plan description)"
        return (f"{self.phase:7s} q={self.q_shape} k={self.k_shape} causal={self.causal}: {what}"
                f"{f' ({self.num_splits} splits)' if self.num_splits > 1 else ''}")


class _PlanLog(list):
    def __init__(self, callback):
        super().__init__()
        self.callback = callback
        self.seen = set()
        self.lock = threading.Lock()


_log: Optional[_PlanLog] = None
_last_log: Optional[_PlanLog] = None


@contextlib.contextmanager
def record_plans(callback: Optional[Callable[[PlanRecord], None]] = None):
    """Record the plan of every distinct attention shape run through ``cuflash.torch`` inside the
    ``with`` block (``cuflash.torch.attention``, ``attention_varlen`` and the transformers
    backend), in order of first use; ``callback(record)`` is called for each new one.

        with cuflash.torch.record_plans() as plans:
            model.generate(...)
        for r in plans: print(r)

    Costs a set lookup per call while active and nothing otherwise."""
    global _log, _last_log
    prev, log = _log, _PlanLog(callback)
    _log = log
    try:
        yield log
    finally:
        _log = prev
        _last_log = log


def last_plans() -> list:
    """The records of the active ``record_plans`` block, or else of the last one."""
    log = _log if _log is not None else _last_log
    return list(log) if log is not None else []


def _record(q, k, causal, extras, varlen=False):
    log = _log
    if log is None:
        return
    win = extras.get("window_size", (-1, -1))
    key = (varlen, tuple(q.shape), tuple(k.shape), q.dtype, bool(causal), win,
           extras.get("softcap", 0.0), "alibi_slopes" in extras, "sinks" in extras,
           tuple(extras["startend_row_indices"].shape) if "startend_row_indices" in extras else None)
    with log.lock:
        if key in log.seen:
            return
        log.seen.add(key)
    plan = None
    if not varlen:
        plan_kw = {n: extras[n] for n in ("window_size", "softcap") if n in extras}
        if "sinks" in extras:
            plan_kw["sinks"] = True
        if "startend_row_indices" in extras:
            plan_kw["startend_row_indices"] = tuple(extras["startend_row_indices"].shape)
        try:
            plan = cuflash.plan(q, k, k, causal=bool(causal), **plan_kw)
        except TypeError:  # a plan that does not depend on these features
            plan = cuflash.plan(q, k, k, causal=bool(causal))
    phase = "varlen" if varlen else ("decode" if q.shape[1] == 1 else "prefill")
    rec = PlanRecord(phase, tuple(q.shape), tuple(k.shape), bool(causal), plan)
    with log.lock:
        log.append(rec)
    if log.callback is not None:
        log.callback(rec)
