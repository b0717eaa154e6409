"""`check_kill` and `check_restart`: a rank SIGKILLed at each point of a window's migration,
then a fresh group restarted from the last checkpoint, compared byte for byte with a run
without the fault (docs/faults.md has the table).

The job: train window 0 (migration from the static placement, one Adam step), checkpoint
(step 1), then window 1: migration (weights + Adam state) and one step, checkpoint (step 2).
`check_kill` runs it with rank ``dead`` killed at one of `KILL_POINTS`; the survivors must
raise within their timeout (none may hang) and, before the migration committed, hold exactly
their state from before window 1. `check_restart` runs, in one fresh group, the fault-free
reference and one restart per faulted folder: load the newest checkpoint marked complete,
plan window 1 from the placement it holds, train it, and report every part of the training
state (`state_figures`) so the caller compares them with the reference's.

A checkpoint (`save_checkpoint`) is complete only once every rank wrote its file (written
to a temporary name, then renamed) and rank 0 marked the step ``COMPLETE`` after an
agreement that every rank saved; `load_checkpoint` takes the newest complete step, so a
step some ranks saved and others did not is never loaded.
"""

from __future__ import annotations

import datetime
import hashlib
import importlib
import os
import signal
import time
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import torch
import torch.distributed as dist

from routepack.plan import Placement
from routepack.torch import export_logical
from routepack.torch.broadcast import gather_ints
from routepack.torch.replay import rank_microbatches
from selfcheck.case import Case, make_plans
from selfcheck.model import EPModel, Weights, fingerprints, inputs, make_groups

#: the module (``routepack.torch.migrate`` the attribute is the function of that name)
migrate_mod = importlib.import_module("routepack.torch.migrate")
#: where `EPMoE`'s slots are packed and written (`StackedState`)
slot_state = importlib.import_module("routepack.torch.slot_state")

#: Where `check_kill` kills its rank, in the order a window reaches them. The migration's
#: protocol points (`routepack.torch.FAULT_POINTS`) are the `migrate` test hook's; the others
#: are set around it here. A slot's weights and its optimizer state travel as one byte string
#: (`slot_state.StackedState.pack`), so they are in flight together; "optimizer" kills a rank
#: inside the commit's copy, between a slot's weights and its optimizer state.
KILL_POINTS: Dict[str, str] = {
    "before": "before the window: the others wait in begin_window's plan agreement",
    "checked": "in migrate: plan checked locally, before the agreement that precedes any move",
    "packed": "weights and optimizer state of the sent slots packed, nothing sent",
    "exchange": "sends and receives posted (weights and optimizer state in flight), not waited for",
    "staged": "every row this rank receives has arrived (staged), nothing verified",
    "verified": "every rank verified every checksum; nothing written yet",
    "commit": "during the commit: the first received slot (weights + optimizer state) written, the rest not",
    "optimizer": "during the commit: a slot's weights written, its optimizer state (Adam moments) not",
    "after": "migration committed on every rank; killed before window 1's forward",
    "checkpoint": "window 1 trained and this rank's step-2 file written; step 2 not marked complete",
}
#: The points before the migration commits on every rank: the survivors keep their state.
BEFORE_COMMIT = ("before", "checked", "packed", "exchange", "staged", "verified", "commit", "optimizer")


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def dying_rank(point: str, case: Case = Case()) -> int:
    """The rank killed at ``point``: during the commit, the rank receiving most rows of
    window 1 (so it has written slots when it dies); in the exchange, a rank sending some;
    elsewhere spread over the ranks (rank 0 too, which marks checkpoints complete)."""
    plan0 = make_plans(case, 0, Placement.static(case.layers, case.experts, case.topology()))[0]
    rows = make_plans(case, 1, plan0.placement)[0].migration
    if point in ("commit", "optimizer"):
        return int(np.argmax(np.bincount(rows["dst_rank"], minlength=case.ep)))
    if point == "exchange":  # a rank that sends, so it posts a transfer to die after
        return int(rows["src_rank"][rows["src_rank"] != rows["dst_rank"]][0])
    return list(KILL_POINTS).index(point) % case.dp


# ------------------------------------------------------------------ training
def fresh_model(case: Case, device: Any, timeout_s: float = 60) -> EPModel:
    """The self-checks' model at step 0 (static placement, weights from the seed). On CUDA,
    torch's deterministic kernels are switched on, so a rerun gives the same bytes."""
    if torch.device(device).type == "cuda":
        torch.use_deterministic_algorithms(True, warn_only=True)
    model = EPModel(case, Weights(case, device), device, make_groups(case.topology()))
    model.runner.timeout = datetime.timedelta(seconds=timeout_s)
    return model


def train_window(
    model: EPModel,
    case: Case,
    w: int,
    device: Any,
    fault: Optional[Callable[[str], None]] = None,
    before_forward: Optional[Callable[[], None]] = None,
) -> None:
    """Window ``w``: its plan migrates from the placement the layers hold now (as a restarted
    job plans from its checkpoint's), then one step over this rank's microbatches (replayed
    routing, Adam)."""
    rank = dist.get_rank()
    previous = Placement(np.stack([mod.phy2log for mod in model.layers]), case.experts, case.slots_per_rank)
    plan, _, window, routed, cu = make_plans(case, w, previous)
    model.runner.begin_window(plan, window, model.opt, fault=fault)
    if before_forward is not None:
        before_forward()
    for mb in rank_microbatches(plan, routed, rank, cu):
        model.runner.start_micro(mb.micro)
        x, r = inputs(case, w, rank, mb.micro, mb.routed.shape[0], device)
        (model(x, mb.routed.to(device)) * r).sum().backward()
    model.runner.finish_step()
    for p in model.routers:
        dist.all_reduce(p.grad)
    model.opt.step()
    model.opt.zero_grad(set_to_none=True)


# --------------------------------------------------------------- checkpoints
def save_checkpoint(model: EPModel, step: int, root: str, after_write: Optional[Callable[[], None]] = None) -> None:
    """Every rank writes ``root/step{step}/rank{r}.pt`` (layers' ``state_dict`` with their
    placement, routers, Adam's ``state_dict``, the step counter) under a temporary name and
    renames it; once every rank confirms (one agreement, bounded by the runner's timeout),
    rank 0 marks the step ``COMPLETE``."""
    rank = dist.get_rank()
    folder = os.path.join(root, f"step{step}")
    os.makedirs(folder, exist_ok=True)
    state = {
        "layers": [mod.state_dict() for mod in model.layers],
        "routers": [p.detach().clone() for p in model.routers],
        "optimizer": model.opt.state_dict(),
        "step": step,
    }
    path = os.path.join(folder, f"rank{rank}.pt")
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)
    if after_write is not None:
        after_write()
    gather_ints([1], None, model.layers[0].w1.device, model.runner.timeout)
    if rank == 0:
        with open(os.path.join(folder, "COMPLETE.tmp"), "w") as f:
            f.write(str(dist.get_world_size()))
        os.replace(os.path.join(folder, "COMPLETE.tmp"), os.path.join(folder, "COMPLETE"))


def complete_steps(root: str) -> List[int]:
    """Steps under ``root`` marked complete, ascending."""
    if not os.path.isdir(root):
        return []
    steps = [int(n[4:]) for n in os.listdir(root) if n.startswith("step") and n[4:].isdigit()]
    return sorted(s for s in steps if os.path.exists(os.path.join(root, f"step{s}", "COMPLETE")))


def load_checkpoint(model: EPModel, root: str, step: Optional[int] = None) -> int:
    """Loads this rank's file of ``step`` (default: the newest complete step) into ``model``:
    layers (weights and placement, `EPMoE.load_state_dict`), routers, Adam; returns the step."""
    if step is None:
        done = complete_steps(root)
        if not done:
            raise FileNotFoundError(f"no complete checkpoint under {root}")
        step = done[-1]
    state = torch.load(os.path.join(root, f"step{step}", f"rank{dist.get_rank()}.pt"), weights_only=False)
    for mod, sd in zip(model.layers, state["layers"]):
        mod.load_state_dict(sd)
    with torch.no_grad():
        for p, saved in zip(model.routers, state["routers"]):
            p.copy_(saved)
    model.opt.load_state_dict(state["optimizer"])
    return int(state["step"])


# ------------------------------------------------------------- the figures
def _sha(t: Any) -> str:
    if isinstance(t, torch.Tensor):
        t = t.detach().contiguous().cpu()
        if t.dim() == 0:
            t = t.reshape(1)
        raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode() + raw).hexdigest()
    return hashlib.sha256(np.ascontiguousarray(t).tobytes()).hexdigest()


def state_figures(model: EPModel, step: int) -> Dict[str, Any]:
    """Every part of the training state, as digests of its bytes (collective: the logical
    parts gather every rank's slots): the step counter; the placement; this rank's slots;
    the logical weights (`export_logical`); each logical expert's weights + Adam moments
    (`fingerprints`); the routers; every tensor of Adam's state (moments and ``step``)."""
    opt_state = model.opt.state_dict()["state"]
    return {
        "step": step,
        "placement": [_sha(mod.phy2log) for mod in model.layers],
        "slots": [[_sha(mod.w1), _sha(mod.w2)] for mod in model.layers],
        "logical_weights": [[_sha(w1), _sha(w2)] for w1, w2 in export_logical(model.layers)],
        "logical_optimizer": sorted((l, e, sorted(d)) for (l, e), d in fingerprints(model.layers, model.opt).items()),
        "routers": [_sha(p) for p in model.routers],
        "optimizer": {f"{i}.{k}": _sha(v) for i, st in sorted(opt_state.items()) for k, v in sorted(st.items())},
    }


def snapshot(model: EPModel) -> List[bytes]:
    """This rank's state, slot by slot (weights + Adam moments, `slot_state.pack_slot`), and
    its placement rows, as bytes."""
    out = []
    for mod in model.layers:
        st = migrate_mod.expert_state(mod, model.opt)
        out += [migrate_mod.pack_slot(st, s).cpu().numpy().tobytes() for s in range(mod.slots_per_rank)]
        out.append(mod.phy2log.tobytes())
    return out


# ------------------------------------------------------------------- checks
def check_kill(rank: int, world: int, device: Any, case: Case, root: str, point: str, dead: int) -> Dict[str, Any]:
    """Window 0 and its checkpoint, then window 1 with rank ``dead`` SIGKILLed at ``point``
    (`KILL_POINTS`). Survivors return what they raised, after how long, and whether their
    state is the one from before window 1 (expected before the commit)."""
    if point not in KILL_POINTS:
        raise ValueError(f"point: {point!r} is not one of {list(KILL_POINTS)}")
    model = fresh_model(case, device, timeout_s=15)
    train_window(model, case, 0, device)
    save_checkpoint(model, 1, root)
    snap = snapshot(model)
    me = rank == dead
    fault = before_forward = after_write = None
    restore: List[Callable[[], None]] = []
    if me and point in migrate_mod.FAULT_POINTS:
        fault = lambda p: die() if p == point else None  # noqa: E731
    elif me and point == "exchange":
        orig_batch = dist.batch_isend_irecv

        def posted_then_die(ops: Any) -> Any:
            orig_batch(ops)
            die()

        dist.batch_isend_irecv = posted_then_die
        restore.append(lambda: setattr(dist, "batch_isend_irecv", orig_batch))
    elif me and point == "optimizer":
        orig_unpack = slot_state.StackedState.unpack

        def weights_then_die(self: Any, slot: int, buf: torch.Tensor) -> None:
            n = slot_state.slot_bytes(self.tensors[:2])  # w1, w2 come first; the Adam moments follow
            slot_state.unpack_slot(self.tensors[:2], slot, buf[:n])
            die()

        slot_state.StackedState.unpack = weights_then_die  # type: ignore[method-assign]
        restore.append(lambda: setattr(slot_state.StackedState, "unpack", orig_unpack))
    elif me and point == "after":
        before_forward = die
    elif me and point == "checkpoint":
        after_write = die
    t0 = time.perf_counter()
    raised = message = None
    try:
        if me and point == "before":
            die()
        train_window(model, case, 1, device, fault=fault, before_forward=before_forward)
        save_checkpoint(model, 2, root, after_write=after_write)
    except Exception as e:  # noqa: BLE001 (the figure is what was raised)
        raised, message = type(e).__name__, str(e).splitlines()[0][:400]
    finally:
        for undo in restore:
            undo()
    return {
        "raised": raised,
        "message": message,
        "seconds": time.perf_counter() - t0,
        "intact": snapshot(model) == snap,
        "complete_steps": complete_steps(root),
    }


def check_restart(rank: int, world: int, device: Any, case: Case, root: str, folders: List[str]) -> Dict[str, Any]:
    """The fault-free reference (``root/reference``: windows 0 and 1, checkpoints at steps 1
    and 2), a restart from its step 1, a mixed checkpoint (rank 0 at step 2, the others at
    step 1: ``mixed``, what it raised), then for each folder of ``folders`` (a `check_kill`
    run's) a restart: a fresh model, the newest complete checkpoint, window 1, a checkpoint.
    Returns `state_figures` of the reference after steps 1 and 2, of the restarted
    reference, and of each restart after loading and after its step, with the step it
    loaded."""
    out: Dict[str, Any] = {}
    ref = os.path.join(root, "reference")
    model = fresh_model(case, device)
    train_window(model, case, 0, device)
    save_checkpoint(model, 1, ref)
    out["reference_step1"] = state_figures(model, 1)
    train_window(model, case, 1, device)
    save_checkpoint(model, 2, ref)
    out["reference_step2"] = state_figures(model, 2)
    # the same restart from the reference's own step 1 (what a world of one rank can check too)
    model = fresh_model(case, device)
    load_checkpoint(model, ref, step=1)
    train_window(model, case, 1, device)
    out["reference_restarted"] = state_figures(model, 2)
    if world > 1:
        # rank 0 on step 2, the others on step 1: what loading each rank's newest file would give
        # after a kill mid-checkpoint; window 1's plan then differs on rank 0 (no rows to move)
        # and begin_window refuses it on every rank before anything moves
        model = fresh_model(case, device)
        load_checkpoint(model, ref, step=2 if rank == 0 else 1)
        snap = snapshot(model)
        try:
            train_window(model, case, 1, device)
            out["mixed"] = {"raised": None}
        except Exception as e:  # noqa: BLE001 (the figures are the type and the message)
            out["mixed"] = {"raised": type(e).__name__, "message": str(e), "intact": snapshot(model) == snap}
    out["restarts"] = {}
    for folder in folders:
        model = fresh_model(case, device)
        step = load_checkpoint(model, folder)
        loaded = state_figures(model, step)
        train_window(model, case, step, device)
        save_checkpoint(model, step + 1, folder)
        out["restarts"][folder] = {"loaded_step": step, "loaded": loaded, "final": state_figures(model, step + 1)}
    return out
