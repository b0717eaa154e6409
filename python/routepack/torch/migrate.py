"""Migration between windows: move experts with all of their optimizer state, atomically.

`migrate` applies ``plan.migration`` (rows ``layer, expert, src_rank, dst_rank, src_slot,
dst_slot``, EP-local; every EP group applies them on its own ranks) to `EPMoE` layers:

1. **check** (local, nothing moves): the rows fit the placement in force and turn it into
   ``plan.placement``; then one all-gather agrees on (ok, plan digest, bytes per slot) so a
   plan refused by any rank, or different plans on different ranks, are refused by all.
2. **transfer**: every moved slot's tensors (weights, each optimizer state tensor shaped like its
   parameter, e.g. Adam's ``exp_avg``/``exp_avg_sq``, and any ``extra_state`` such as fp32
   master weights) are packed as raw bytes and sent with one batched point-to-point exchange
   (local moves are copies) into receive buffers. Nothing is written to the live tensors.
3. **verify**: sender and receiver checksum each row; one all-gather of (status, checksums)
   decides on every rank alike: commit only if every rank received and every row matches.
4. **commit**: each rank backs up the slots it overwrites and copies the received bytes in;
   one more all-gather confirms every rank committed, otherwise every rank restores its backup.

A failure on any rank (an exception, a bad checksum, a timeout) makes every rank raise
`MigrationError` with its previous weights and optimizer state intact. Each rank keeps
taking part in every exchange of the protocol even after a local failure (sending
placeholders), so a raised exception never leaves a peer waiting; waits are bounded by
``timeout`` for the cases where a peer is gone. Bytes are copied bit for bit: after a
migration every logical expert's weights and optimizer state are identical to before.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from routepack._deprecation import renamed
from routepack.errors import InvalidPlanError, RoutepackError, RoutepackTypeError
from routepack.plan import MIGRATION_DTYPE, Plan
from routepack.torch import _args
from routepack.torch.broadcast import AgreementError, check_same_plan, digest_int, gather_ints
from routepack.torch.moe import check_layers
from routepack.torch.pipeline import stage_plan
from routepack.torch.slot_state import (  # pack_slot, slot_bytes, unpack_slot: re-exported (their old home)
    SlotState,
    StackedState,
    pack_slot,  # noqa: F401
    slot_bytes,  # noqa: F401
    stateful_owner,
    unpack_slot,  # noqa: F401
)
from routepack.torch.waves import plan_waves

#: Where a test's fault hook is called, in protocol order ("staged": every row this rank
#: receives is in its receive buffer).
FAULT_POINTS = ("checked", "packed", "staged", "verified", "commit")
#: gloo tags of migration messages (replica transfers use small tags; see replicate.py).
_TAG_BASE = 1 << 29


class MigrationError(RuntimeError):
    """A migration was aborted; every rank kept or restored its previous state."""


@dataclass(frozen=True)
class MigrationReport:
    """What this rank did: rows applied in its EP group, bytes it sent and received over the
    network, slots it filled by a local copy, wall seconds; the number of waves the layers
    moved in and the peak extra bytes any EP rank held at once in them (`waves.plan_waves`).
    ``stages``, the old name of ``waves``, still reads with a DeprecationWarning."""

    rows: int
    sent_bytes: int
    received_bytes: int
    local_copies: int
    seconds: float
    waves: int = 1
    peak_bytes: int = 0

    @property
    def stages(self) -> int:
        """Deprecated: `waves`."""
        renamed("MigrationReport.stages", "MigrationReport.waves")
        return self.waves


def expert_state(
    layer: Any, optimizer: Optional[torch.optim.Optimizer] = None, extra: Sequence[torch.Tensor] = ()
) -> List[torch.Tensor]:
    """Tensors with one entry per physical slot of ``layer`` that travel with an expert:
    ``w1``, ``w2``, every optimizer state tensor of theirs with one row per slot (sorted by
    key), and ``extra`` (each with leading dimension ``slots_per_rank``).

    Works for any ``torch.optim`` optimizer whose state is keyed by the parameters (Adam,
    AdamW, SGD with momentum, RMSprop, Adagrad, Adafactor's factored ``row_var``/``col_var``,
    ...): a state tensor whose leading dimension is ``slots_per_rank`` moves with the rows;
    a scalar (``step``, ASGD's ``eta``) belongs to the whole parameter and stays. Raises
    `RoutepackError` naming the parameter and key for anything else, and when the optimizer
    does not hold ``w1``/``w2`` themselves (a flat or sharded fp32 state such as Megatron's
    DistributedOptimizer, whose master copy would silently undo the move): never ignores it."""
    out: List[torch.Tensor] = [layer.w1, layer.w2]
    if optimizer is not None:
        out.extend(optimizer_rows(layer, optimizer))
    for i, t in enumerate(extra):
        if t.dim() == 0 or t.shape[0] != layer.slots_per_rank:
            raise RoutepackError(
                f"extra_state[{layer.layer}][{i}]: leading dimension must be "
                f"slots_per_rank={layer.slots_per_rank}, got shape {tuple(t.shape)}"
            )
        out.append(t)
    return out


def optimizer_rows(layer: Any, optimizer: Any) -> List[torch.Tensor]:
    """``optimizer``'s per-slot state tensors of ``layer.w1`` and ``layer.w2`` (see
    `expert_state`), after checking that the optimizer owns both and that every state entry
    is either per-slot or a per-parameter scalar."""
    if not hasattr(optimizer, "param_groups") or not hasattr(optimizer, "state"):
        raise RoutepackTypeError(
            f"optimizer: expected a torch.optim.Optimizer keyed by parameter, got "
            f"{type(optimizer).__name__} (pass its inner torch optimizer, or move its state "
            "with extra_state)"
        )
    owned = {id(p) for g in optimizer.param_groups for p in g["params"]}
    out: List[torch.Tensor] = []
    spr = layer.slots_per_rank
    for pname, p in (("w1", layer.w1), ("w2", layer.w2)):
        name = f"layers[{layer.layer}].{pname}"
        if id(p) not in owned:
            raise RoutepackError(
                f"optimizer: does not hold {name} (shape {tuple(p.shape)}) among its parameters, so its state "
                f"cannot be moved with the expert rows ({type(optimizer).__name__}: a flat or sharded state such as "
                "Megatron's DistributedOptimizer keeps fp32 master copies that would undo the migration); pass an "
                "optimizer keyed by the layer's parameters, or the per-slot tensors as extra_state"
            )
        st = optimizer.state.get(p, {})
        for k in sorted(st, key=str):
            v = st[k]
            if v is None or not torch.is_tensor(v):
                continue  # e.g. SGD's momentum_buffer before the first step, python scalars
            if v.dim() == 0:
                continue  # per-parameter scalar (step, eta, mu_product): every slot shares it
            if v.shape[0] != spr:
                raise RoutepackError(
                    f"optimizer.state[{name}][{k!r}]: shape {tuple(v.shape)} has no row per slot "
                    f"(leading dimension {spr}) and is no scalar; routepack cannot move it with the expert rows"
                )
            if v.device != p.device:
                raise RoutepackError(
                    f"optimizer.state[{name}][{k!r}]: on {v.device}, the parameter on {p.device} "
                    "(an offloaded state is not moved; pass it as extra_state)"
                )
            out.append(v)
    return out


def checksum(buf: torch.Tensor) -> int:
    """Position-sensitive 63-bit checksum of a uint8 buffer, computed where it lives.

    Words are summed plainly and weighted by their position within 65536-word chunks (partial
    sums stay below 2^63), and the chunk sums are mixed on the host with wrapping arithmetic.
    ``buf`` must be a 1-D ``torch.uint8`` tensor (view another tensor's bytes with
    ``t.reshape(-1).view(torch.uint8)``); an empty buffer's checksum is 0."""
    if not isinstance(buf, torch.Tensor):
        raise RoutepackTypeError(f"buf: expected a 1-D torch.uint8 tensor, got {type(buf).__name__}")
    if buf.dtype != torch.uint8:
        raise RoutepackTypeError(
            f"buf: expected a byte buffer (dtype torch.uint8), got dtype {buf.dtype}; "
            "pass t.reshape(-1).view(torch.uint8) to checksum a tensor's bytes"
        )
    if buf.dim() != 1:
        raise RoutepackError(f"buf: expected a 1-D byte buffer, got shape {tuple(buf.shape)}")
    if buf.numel() == 0:
        return 0
    chunk = 1 << 16
    pad = (-buf.numel()) % (4 * chunk)
    words = torch.cat([buf, buf.new_zeros(pad)]).view(torch.int32).view(-1, chunk)
    weight = torch.arange(1, chunk + 1, dtype=torch.int64, device=buf.device)
    plain, weighted = [], []
    for i in range(0, words.shape[0], 64):
        w = words[i : i + 64].to(torch.int64)
        plain.append(w.sum(1))
        weighted.append((w * weight).sum(1))
    p = torch.cat(plain).cpu().numpy().astype(np.uint64)
    q = torch.cat(weighted).cpu().numpy().astype(np.uint64)
    mix = np.arange(1, p.size + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    with np.errstate(over="ignore"):
        total = int((p * mix + q).sum(dtype=np.uint64)) ^ buf.numel()
    return total & ((1 << 63) - 1)


def check_migration(layers: Sequence[Any], plan: Any) -> None:
    """Local check that ``plan.migration`` turns the layers' placement into ``plan.placement``:
    shapes agree, each row's source slot holds its expert now and its destination slot holds it
    in the plan, no slot is filled twice, and every slot whose expert changes is filled by a
    row. Raises `InvalidPlanError` naming the row or slot."""
    p = plan.placement
    if p.num_layers != len(layers):
        raise InvalidPlanError(f"plan has {p.num_layers} MoE layers; the model has {len(layers)}")
    mod0 = layers[0]
    if (
        p.num_slots != mod0.topo.num_slots
        or p.slots_per_rank != mod0.slots_per_rank
        or p.num_experts != mod0.num_experts
    ):
        raise InvalidPlanError(
            f"plan placement has {p.num_slots} slots ({p.slots_per_rank} per rank) for E={p.num_experts}; "
            f"the model has {mod0.topo.num_slots} ({mod0.slots_per_rank} per rank) for E={mod0.num_experts}"
        )
    spr = mod0.slots_per_rank
    filled: Dict[tuple, int] = {}
    for i, r in enumerate(plan.migration):
        l, e, ss, ds = int(r["layer"]), int(r["expert"]), int(r["src_slot"]), int(r["dst_slot"])
        if not (0 <= l < len(layers) and 0 <= ss < p.num_slots and 0 <= ds < p.num_slots):
            raise InvalidPlanError(f"migration row {i} is out of range: {r}")
        if int(r["src_rank"]) != ss // spr or int(r["dst_rank"]) != ds // spr:
            raise InvalidPlanError(f"migration row {i}: slot and rank disagree: {r}")
        if layers[l].phy2log[ss] != e:
            raise InvalidPlanError(
                f"migration row {i} moves expert {e} from slot {ss} of layer {l}, "
                f"which holds {layers[l].phy2log[ss]} now"
            )
        if p.phy2log[l, ds] != e:
            raise InvalidPlanError(
                f"migration row {i} moves expert {e} into slot {ds} of layer {l}, "
                f"but the plan puts {p.phy2log[l, ds]} there"
            )
        if (l, ds) in filled:
            raise InvalidPlanError(f"migration rows {filled[(l, ds)]} and {i} both fill slot {ds} of layer {l}")
        filled[(l, ds)] = i
    for l, mod in enumerate(layers):
        for s in np.flatnonzero((p.phy2log[l] >= 0) & (p.phy2log[l] != mod.phy2log)).tolist():
            if (l, s) not in filled:
                raise InvalidPlanError(
                    f"plan puts expert {p.phy2log[l, s]} in slot {s} of layer {l}, which holds "
                    f"{mod.phy2log[s]} now, and no migration row fills it"
                )


def _hook(fault: Optional[Callable[[str], None]], point: str) -> None:
    if fault is not None:
        fault(point)


def migrate(
    layers: Sequence[Any],
    plan: Any,
    optimizer: Optional[torch.optim.Optimizer] = None,
    *,
    group: Optional[Any] = None,
    timeout: datetime.timedelta = datetime.timedelta(seconds=120),
    extra_state: Optional[Dict[int, Sequence[torch.Tensor]]] = None,
    fault: Optional[Callable[[str], None]] = None,
    max_bytes_in_flight: Optional[int] = None,
) -> MigrationReport:
    """Applies ``plan.migration`` to ``layers`` (this rank's `EPMoE` layers, index = MoE layer)
    together with ``optimizer``'s state and ``extra_state[layer]``. Collective over the EP
    ``group``. Under a pipeline (``topo.pp`` > 1) ``layers`` are a stage's, ascending by
    `EPMoE.layer`: the plan's rows and placement of those MoE layers are applied
    (`routepack.torch.pipeline.stage_plan`), and ``extra_state`` is keyed by `EPMoE.layer`. Raises `InvalidPlanError` before anything moves when the plan does not fit,
    `MigrationError` when the move was aborted (state intact on every rank). ``fault`` is a
    test hook called with each of `FAULT_POINTS`.

    ``optimizer=None`` with migration rows is refused (`RoutepackError`, nothing moves) when
    an optimizer that has stepped keeps state for the layers' ``w1``/``w2``: its rows would
    stay with the old slots (`routepack.torch.slot_state.stateful_owner`).

    ``max_bytes_in_flight``: the ceiling on the extra memory any EP rank holds at once (its
    received copies, the backups of the slots it overwrites and its packed sends;
    `routepack.torch.waves`). Layers are then moved a few at a time, each wave transferred,
    verified and committed on its own: atomic per wave, so an abort in a later wave leaves
    the layers of earlier waves on the plan's placement (the error names them) and the
    rest on their previous one. None (default): one wave, atomic over all layers. Every
    rank passes the same value; a single layer above the ceiling is refused before anything
    moves (`RoutepackError` naming the layer, the rank and the bytes)."""
    # arguments every rank passes alike (the layers, the group, the timeout): a bad one fails
    # on every rank at once, before any exchange
    layers = check_layers(layers)
    if extra_state is not None and not isinstance(extra_state, dict):
        raise RoutepackTypeError(f"extra_state: expected a dict layer -> tensors, got {type(extra_state).__name__}")
    extra = extra_state or {}
    # a pipeline stage's layers carry out the plan's rows of their MoE layers (`EPMoE.layer`)
    piped = layers[0].topo.pp > 1
    ids = [mod.layer for mod in layers] if piped else None

    def states() -> List[SlotState]:
        if optimizer is None and isinstance(plan, Plan) and plan.migration.size:
            owner = stateful_owner([p for mod in layers for p in (mod.w1, mod.w2)])
            if owner is not None:
                raise RoutepackError(
                    f"optimizer: None, but {owner} keeps state for the layers' w1/w2; the plan moves "
                    f"{plan.migration.size} experts and that state would stay with the old slots: pass the optimizer"
                )
        return [
            StackedState(expert_state(mod, optimizer, extra.get(mod.layer if piped else l, ())))
            for l, mod in enumerate(layers)
        ]

    return migrate_slots(
        layers,
        plan,
        states,
        group=group,
        timeout=timeout,
        fault=fault,
        max_bytes_in_flight=max_bytes_in_flight,
        device=layers[0].w1.device,
        layer_ids=ids,
    )


def migrate_slots(
    layers: Sequence[Any],
    plan: Any,
    states: Callable[[], List[SlotState]],
    *,
    group: Optional[Any] = None,
    timeout: datetime.timedelta = datetime.timedelta(seconds=120),
    fault: Optional[Callable[[str], None]] = None,
    max_bytes_in_flight: Optional[int] = None,
    device: Any = None,
    layer_ids: Optional[Sequence[int]] = None,
) -> MigrationReport:
    """`migrate`'s protocol for any slot layout. ``layers``: one object per MoE layer of the
    plan with the attributes `check_migration` reads (``phy2log``, settable; ``topo``,
    ``slots_per_rank``, ``num_experts``) and ``ep_rank`` / ``peers`` (the EP group's global
    ranks); ``states()`` builds each layer's `SlotState` (called in the check phase: an error
    there refuses the plan on every rank, a `RoutepackError` as "cannot map"); ``device``:
    where the protocol's small exchanges live. ``layer_ids``: the plan's MoE layer of each
    entry of ``layers`` (ascending; a pipeline stage's), whose rows alone are carried out
    (`routepack.torch.pipeline.stage_plan`); None: ``layers`` is every layer of the plan, in
    order. See `migrate` for the rest."""
    t0 = time.perf_counter()
    _args.group(group)
    _args.timeout(timeout, optional=False)
    layers = list(layers)
    mod0 = layers[0]
    me = mod0.ep_rank
    rows = np.zeros(0, dtype=MIGRATION_DTYPE)

    # 1. check, then agree before anything moves
    err: Optional[BaseException] = None
    st: List[SlotState] = []
    sizes: List[int] = []
    waves: List[tuple] = []
    moved: set = set()
    peak = 0
    digest = 0
    try:
        if not isinstance(plan, Plan):
            raise InvalidPlanError(f"plan: expected routepack.Plan, got {type(plan).__name__}")
        digest = digest_int(plan)
        if layer_ids is not None:
            plan = stage_plan(plan, layer_ids)
        rows = plan.migration
        check_migration(layers, plan)
        st = states()
        sizes = [s.nbytes for s in st]
        waves, peak = plan_waves(rows, sizes, mod0.topo.ep, max_bytes_in_flight)
        moved = {l for ls, _ in waves for l in ls}
        _hook(fault, "checked")
    except Exception as e:  # noqa: BLE001 (reported to every rank, then re-raised)
        err = e
    # status: 1 ok, 0 the plan was refused, 3 an argument (optimizer, extra_state) cannot be
    # mapped, 2 anything else went wrong here
    status = (
        1 if err is None else (0 if isinstance(err, InvalidPlanError) else 3 if isinstance(err, RoutepackError) else 2)
    )
    ceiling = -1 if max_bytes_in_flight is None else int(max_bytes_in_flight)
    try:
        got = gather_ints([status, digest, digest_of_sizes(sizes), ceiling], group, device, timeout)
    except AgreementError as e:
        raise MigrationError(f"{e} (before the move; nothing moved)") from e
    if err is not None:
        if status in (0, 3):
            raise err
        raise MigrationError(f"EP rank {me}: {err!r}; nothing moved") from err
    if (got[:, 0] == 0).any():
        raise InvalidPlanError(f"EP rank(s) {np.flatnonzero(got[:, 0] == 0).tolist()} refused the plan; nothing moved")
    if (got[:, 0] == 3).any():
        raise RoutepackError(
            f"EP rank(s) {np.flatnonzero(got[:, 0] == 3).tolist()} cannot map their optimizer or "
            "extra state (each raised its own error); nothing moved"
        )
    if (got[:, 0] == 2).any():
        raise MigrationError(f"EP rank(s) {np.flatnonzero(got[:, 0] == 2).tolist()} failed to prepare; nothing moved")
    check_same_plan(got[:, 1], "EP ranks")
    if np.unique(got[:, 2]).size != 1:
        raise MigrationError("expert state (weights + optimizer state) differs in size between EP ranks; nothing moved")
    if np.unique(got[:, 3]).size != 1:
        raise RoutepackError(
            f"max_bytes_in_flight: EP ranks passed different values {got[:, 3].tolist()} (-1: None); nothing moved"
        )

    # 2-4 per wave (a few layers whose extra memory fits max_bytes_in_flight; one wave
    # holding every layer without a ceiling): transfer, verify, commit
    totals = [0, 0, 0]
    done: List[int] = []
    for k, (wave_layers, idx) in enumerate(waves):
        last = k == len(waves) - 1
        # the last wave also installs the placement of layers without rows (slots emptied)
        install = sorted(set(wave_layers) | ({l for l in range(len(layers))} - set(moved)) if last else wave_layers)
        try:
            sent_b, recv_b, local_n = _move_wave(layers, plan, rows, idx, install, st, group, timeout, fault, device)
        except MigrationError as e:
            if done:
                raise MigrationError(
                    f"{e} (wave {k + 1} of {len(waves)}; layers {done} were moved by earlier "
                    "waves and keep the plan's placement, the others their previous one)"
                ) from e
            raise
        for j, v in enumerate((sent_b, recv_b, local_n)):
            totals[j] += v
        done.extend(install)
    return MigrationReport(
        rows=len(rows),
        sent_bytes=totals[0],
        received_bytes=totals[1],
        local_copies=totals[2],
        seconds=time.perf_counter() - t0,
        waves=len(waves),
        peak_bytes=peak,
    )


def _prepare(layers: List[Any], rows: np.ndarray, idx: Sequence[int], st: List[SlotState]) -> None:
    """Each layer's `SlotState.prepare` with the local slots this rank packs in this wave
    (every layer of the wave, in order, on every rank)."""
    me, spr = layers[0].ep_rank, layers[0].slots_per_rank
    by_layer: Dict[int, List[int]] = {}
    for i in idx:
        r = rows[i]
        by_layer.setdefault(int(r["layer"]), [])
        if int(r["src_rank"]) == me:
            by_layer[int(r["layer"])].append(int(r["src_slot"]) - me * spr)
    for l in sorted(by_layer):
        st[l].prepare(by_layer[l])


def _move_wave(
    layers: List[Any],
    plan: Plan,
    rows: np.ndarray,
    idx: Sequence[int],
    install: Sequence[int],
    st: List[SlotState],
    group: Any,
    timeout: datetime.timedelta,
    fault: Optional[Callable[[str], None]],
    device: Any,
) -> tuple:
    """Transfers, verifies and commits migration rows ``idx`` (global row indices), then sets the
    placement of layers ``install``; all or nothing on every rank. Returns (bytes sent, bytes
    received, local copies)."""
    mod0 = layers[0]
    me, spr, peers = mod0.ep_rank, mod0.slots_per_rank, mod0.peers
    err: Optional[BaseException] = None
    # 2. transfer: pack, exchange into receive buffers; never touch live tensors
    received: Dict[int, torch.Tensor] = {}
    sent: Dict[int, torch.Tensor] = {}
    ops = []
    sent_bytes = recv_bytes = local = 0
    try:
        _prepare(layers, rows, idx, st)
        for i in idx:
            r = rows[i]
            l, s_rank, d_rank = int(r["layer"]), int(r["src_rank"]), int(r["dst_rank"])
            if s_rank == me and d_rank == me:
                received[i] = st[l].pack(int(r["src_slot"]) - me * spr).clone()
                sent[i] = received[i]
                local += 1
            elif s_rank == me:
                sent[i] = st[l].pack(int(r["src_slot"]) - me * spr)
            elif d_rank == me:
                received[i] = torch.empty(st[l].nbytes, dtype=torch.uint8, device=device)
        _hook(fault, "packed")
    except Exception as e:  # noqa: BLE001
        err = e
    try:
        for i in idx:
            r = rows[i]
            l, s_rank, d_rank = int(r["layer"]), int(r["src_rank"]), int(r["dst_rank"])
            if s_rank == d_rank:
                continue
            if s_rank == me:
                # after a local failure, still send (placeholder bytes) so the peer is not left waiting
                buf = sent.get(i)
                if buf is None or buf.numel() != st[l].nbytes:
                    buf = sent[i] = torch.zeros(st[l].nbytes, dtype=torch.uint8, device=device)
                ops.append(dist.P2POp(dist.isend, buf, peers[d_rank], group, _TAG_BASE + i))
                sent_bytes += buf.numel()
            elif d_rank == me:
                if i not in received:
                    received[i] = torch.empty(st[l].nbytes, dtype=torch.uint8, device=device)
                ops.append(dist.P2POp(dist.irecv, received[i], peers[s_rank], group, _TAG_BASE + i))
                recv_bytes += received[i].numel()
        for w in dist.batch_isend_irecv(ops) if ops else []:
            w.wait(timeout)
        _hook(fault, "staged")
    except Exception as e:  # noqa: BLE001
        err = err or e

    # 3. verify: every rank sees every rank's status and both checksums of every row
    sums = np.zeros((len(idx), 2), dtype=np.int64)
    if err is None:
        try:
            for n, i in enumerate(idx):
                if int(rows[i]["src_rank"]) == me:
                    sums[n, 0] = checksum(sent[i])
                if int(rows[i]["dst_rank"]) == me:
                    sums[n, 1] = checksum(received[i])
        except Exception as e:  # noqa: BLE001
            err = e
    try:
        got = gather_ints([int(err is None)] + sums.reshape(-1).tolist(), group, device, timeout)
    except Exception as e:  # a peer is gone: nothing was written here, so just abort
        raise MigrationError(f"EP rank {me}: verification exchange failed ({e!r}); nothing moved") from e
    failed = np.flatnonzero(got[:, 0] == 0).tolist()
    if failed:
        raise MigrationError(
            f"EP rank(s) {failed} failed to transfer"
            + (f" (here: {err!r})" if err is not None else "")
            + "; nothing moved"
        ) from err
    both = got[:, 1:].reshape(got.shape[0], len(idx), 2).sum(axis=0)
    bad = [int(idx[n]) for n in np.flatnonzero(both[:, 0] != both[:, 1]).tolist()]
    if bad:
        raise MigrationError(f"checksum mismatch on migration rows {bad}; nothing moved")
    sent.clear()  # the packed sources are no longer needed: free them before the backups

    # 4. commit with backups, then confirm on every rank
    backups: List[tuple] = []
    old_rows = {l: layers[l].phy2log.copy() for l in install}
    try:
        _hook(fault, "verified")
        mine = [i for i in idx if int(rows[i]["dst_rank"]) == me]
        for i in mine:
            l, slot = int(rows[i]["layer"]), int(rows[i]["dst_slot"]) - me * spr
            backups.append((l, slot, st[l].backup(slot)))
        for n, i in enumerate(mine):
            l, slot = int(rows[i]["layer"]), int(rows[i]["dst_slot"]) - me * spr
            st[l].unpack(slot, received.pop(i))
            if n == 0:
                _hook(fault, "commit")
        for l in install:
            layers[l].phy2log = plan.placement.phy2log[l].astype(np.int32, copy=True)
        err = None
    except Exception as e:  # noqa: BLE001
        err = e
    try:
        got = gather_ints([int(err is None)], group, device, timeout)
        failed = np.flatnonzero(got[:, 0] == 0).tolist()
    except Exception as e:  # noqa: BLE001
        failed, err = [-1], err or e
    if failed:
        for l, slot, saved in reversed(backups):
            st[l].restore(slot, saved)
        for l, row in old_rows.items():
            layers[l].phy2log = row
        who = "a peer is unreachable" if failed == [-1] else f"EP rank(s) {failed} failed to commit"
        raise MigrationError(f"{who}; every slot restored" + (f" (here: {err!r})" if err is not None else "")) from err
    return sent_bytes, recv_bytes, local


def digest_of_sizes(sizes: Sequence[int]) -> int:
    """One int standing for the per-layer slot sizes (equal on every rank when states agree)."""
    h = 1469598103934665603
    for s in list(sizes) + [len(sizes)]:
        h = ((h ^ int(s)) * 1099511628211) & ((1 << 63) - 1)
    return h
