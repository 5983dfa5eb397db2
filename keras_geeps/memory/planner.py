"""GeePS's memory planner: what stays on the device, what is staged through it.

From the recorded step (`AccessSequence`) and a device-memory budget the
planner decides, before training, where every item lives:

- a parameter table (a layer's parameters and its optimizer state) is
  *resident* (kept on the device for the whole run) or *staged* (kept in
  host memory, pinned on a GPU, and brought to the device only around its
  accesses: its forward read, then its backward read and update);
- a saved activation (a layer's input, kept from forward to backward) stays
  on the device or is *offloaded* to host memory between the two passes
  (only when asked: `offload_activations`).

Everything staged passes through one *access pool* on the device, sized to
twice the peak working set: the largest set of staged bytes one layer's
step touches at once (its staged table, plus its offloaded input, plus its
offloaded output when its backward reads it). Twice, so that the next
access can be brought in while the current one is in use (double
buffering), in first-access order, as GeePS does.

The device then holds at most
    resident tables + non-trainable variables + pool
    + activations kept on the device + tapes kept
(+ the offloaded activations on their way out: at most three consecutive
ones, as the trainer waits for each before the layer after next), and the
plan fits when that is within the budget. Layers before the first one with
parameters keep no input (no gradient reaches them): while one runs, its input
and output are all the activations on the device. A "taped" layer (see
`MemoryPlan.modes`) keeps its forward pass's tape until its backward, and the
tape keeps tensors of its own (a dropout mask, an activation's input): they are
estimated at one tensor of the layer's output size each (`tape_bytes`). Not
covered: a tape keeping more than that (a gelu or a normalization keeps several
intermediates), TensorFlow's workspace (gradients, kernel scratch, a
recomputed layer's tape during its backward), and a recomputed layer's copy
of the non-trainable variables its forward writes (BatchNorm statistics, a
dropout's seed; not a frozen layer's weights), kept from its forward to its
backward; `DeviceLedger` counts none of them either. Tables are staged in
first-access order (the first layers' data waits longest between its
forward and backward use, so its prefetch has the most slack) until the
rest fits; then, with `offload_activations="auto"`, activations are
offloaded in the same order. Every pool size that could work is
tried and the plan moving the fewest bytes per step is kept. The search is
greedy, not exhaustive (it takes O(layers^2) steps): its smallest total, the
`minimum_budget`, is the smallest budget it finds a plan for, and a budget
below it raises `MemoryBudgetError` naming it. Rarely a plan the search does
not reach fits in less (a move that frees little but enlarges the pool, taken
first, can keep out a better one): `offload_activations` naming the layers may
reach it.
"""

import math
import numbers

from keras_geeps.errors import GeePSError
from keras_geeps.memory.recorder import SWAPPABLE_DTYPES


class MemoryBudgetError(GeePSError, ValueError):
    """The device-memory budget is below every plan the planner finds.

    Attributes:
        budget: the budget asked for, in bytes.
        minimum_budget: the smallest budget the planner finds a plan for,
            in bytes (its search is greedy: see `plan`).
    """

    def __init__(self, budget, minimum_budget, detail=""):
        self.budget = budget
        self.minimum_budget = minimum_budget
        super().__init__(
            f"device_memory_budget={budget:,} bytes cannot hold the access "
            f"pool and what must stay on the device in any plan the planner "
            f"finds; the minimum budget it finds a plan for, for this model "
            f"and batch size, is {minimum_budget:,} bytes "
            f"({minimum_budget / 2**20:.2f} MiB){detail}")


def _fmt(n):
    return f"{n:,}" if n is not None else "unlimited"


class MemoryPlan:
    """Where every table and activation of a step lives, and the figures.

    Attributes:
        sequence: the `AccessSequence` planned.
        budget: the budget in bytes (None: unlimited).
        staged: per unit, True when its table is staged (host-resident).
        offloaded: per unit, True when its input activation is offloaded.
        modes: per unit, how its backward runs: "explicit", "taped" (the
            forward's tape is kept), "recompute" (its forward is run
            again from its saved input, because its parameters or input
            left the device) or "none" (before the first layer with
            parameters: no gradient reaches it).
        resident_bytes: tables (parameters + optimizer state) kept on the
            device, plus every non-trainable variable (frozen layers,
            BatchNorm statistics: never staged, `fixed_bytes`).
        fixed_bytes: the non-trainable variables' bytes.
        staged_bytes: tables kept in host memory.
        peak_working_set: the largest staged working set of one step.
        pool_bytes: the access pool, 2 x `peak_working_set`.
        activation_device_bytes: saved activations kept on the device (plus
            offloaded ones on their way out).
        activation_host_bytes: saved activations offloaded to host memory.
        tape_bytes: the estimate of what the taped layers' tapes keep from
            forward to backward: each one output of the layer.
        device_bytes: resident + pool + activations on the device + tapes,
            the most the plan holds at once; within the budget.
        minimum_budget: the smallest budget the planner finds a plan for
            (its search is greedy: see `plan`).
        traffic_bytes: host<->device bytes moved per step.
        prefetch_order: the staged accesses in the order the prefetcher
            brings them in: (position, item, bytes); a table's backward
            fetch brings its optimizer state along.
    """

    def __init__(self, sequence, budget, staged, offloaded, minimum_budget):
        self.sequence = sequence
        self.budget = budget
        self.staged = list(staged)
        self.offloaded = list(offloaded)
        self.minimum_budget = minimum_budget
        figures = _evaluate(sequence, self.staged, self.offloaded)
        (self.device_bytes, self.pool_bytes, self.peak_working_set,
         self.resident_bytes, self.activation_device_bytes,
         self.tape_bytes) = figures
        units = sequence.units
        self.fixed_bytes = sequence.fixed_bytes
        self.staged_bytes = sum(u.table_bytes for u, s in
                                zip(units, self.staged) if s)
        self.activation_host_bytes = sum(u.input_bytes for u, o in
                                         zip(units, self.offloaded) if o)
        self.traffic_bytes = _traffic(sequence, self.staged, self.offloaded)
        self.modes = _modes(sequence, self.staged, self.offloaded)
        self.prefetch_order = self._prefetch_order()

    # ------------------------------------------------------------ queries
    @property
    def units(self):
        return self.sequence.units

    def placement(self, item):
        """"device" or "host" for an item ("table:NAME", "act:NAME",
        "state:NAME" or "output")."""
        if item == "output":
            return "device"
        kind, name = item.split(":", 1)
        for u in self.units:
            if u.name == name:
                if kind in ("table", "state"):
                    return "host" if self.staged[u.index] else "device"
                return "host" if self.offloaded[u.index] else "device"
        raise KeyError(item)

    @property
    def resident_tables(self):
        return [u.name for u in self.units if u.has_params and
                not self.staged[u.index]]

    @property
    def staged_tables(self):
        return [u.name for u in self.units if self.staged[u.index]]

    @property
    def offloaded_activations(self):
        return [u.name for u in self.units if self.offloaded[u.index]]

    def _prefetch_order(self):
        order, seen = [], set()
        for a in self.sequence.accesses:
            if a.kind == "update" or a.item == "output":
                continue
            if a.phase == "forward" and a.kind == "local":
                continue  # the forward produces activations, not fetches
            if (a.phase, a.item) in seen or a.item.startswith("state:"):
                # an output fetched as the next layer's input already; the
                # optimizer state comes in with its table
                continue
            seen.add((a.phase, a.item))
            if self.placement(a.item) == "host":
                nbytes = a.nbytes
                if a.phase == "backward" and a.item.startswith("table:"):
                    nbytes = self.units[a.unit].table_bytes
                order.append((a.position, a.item, nbytes))
        return order

    def figures(self):
        """The plan's numbers as a dict (for logs and benchmarks)."""
        return {
            "budget": self.budget, "resident_bytes": self.resident_bytes,
            "staged_bytes": self.staged_bytes,
            "fixed_bytes": self.fixed_bytes,
            "peak_working_set": self.peak_working_set,
            "pool_bytes": self.pool_bytes,
            "activation_device_bytes": self.activation_device_bytes,
            "activation_host_bytes": self.activation_host_bytes,
            "tape_bytes": self.tape_bytes,
            "device_bytes": self.device_bytes,
            "minimum_budget": self.minimum_budget,
            "traffic_bytes": self.traffic_bytes,
            "staged_tables": len(self.staged_tables),
            "resident_tables": len(self.resident_tables),
            "recomputed_layers": self.modes.count("recompute"),
        }

    def __str__(self):
        seq = self.sequence
        lines = [f"{'item':<40} {'bytes':>14} {'where':<7} {'first':>5}  "
                 f"backward"]
        for u in self.units:
            mode = self.modes[u.index]
            if u.has_params:
                where = "host" if self.staged[u.index] else "device"
                lines.append(f"{('table:' + u.name)[:40]:<40} "
                             f"{u.table_bytes:>14,} {where:<7} "
                             f"{seq.first_access('table:' + u.name):>5}  "
                             f"{mode}")
            where = "host" if self.offloaded[u.index] else "device"
            lines.append(f"{('act:' + u.name)[:40]:<40} {u.input_bytes:>14,}"
                         f" {where:<7} {seq.first_access('act:' + u.name):>5}"
                         f"  {'' if u.has_params else mode}")
        lines.append(f"{'output':<40} {seq.output_bytes:>14,} {'device':<7} "
                     f"{seq.first_access('output'):>5}")
        lines.append("")
        lines.append(f"budget {_fmt(self.budget)} B; device total "
                     f"{self.device_bytes:,} B = resident "
                     f"{self.resident_bytes:,}"
                     f" (non-trainable {self.fixed_bytes:,})"
                     f" + pool {self.pool_bytes:,} (2 x peak working set "
                     f"{self.peak_working_set:,}) + activations "
                     f"{self.activation_device_bytes:,} + tapes "
                     f"{self.tape_bytes:,}")
        lines.append(f"staged (host) tables {self.staged_bytes:,} B; "
                     f"offloaded activations {self.activation_host_bytes:,} B;"
                     f" traffic {self.traffic_bytes:,} B/step; minimum budget "
                     f"{self.minimum_budget:,} B")
        return "\n".join(lines)

    def __repr__(self):
        return (f"MemoryPlan(budget={_fmt(self.budget)}, resident="
                f"{self.resident_bytes:,}, staged={self.staged_bytes:,}, "
                f"pool={self.pool_bytes:,}, peak_working_set="
                f"{self.peak_working_set:,})")


# ------------------------------------------------------------ the figures
def _working_sets(sequence, staged, offloaded):
    """Staged bytes each step of the sequence touches at once."""
    units = sequence.units
    last = len(units) - 1
    sets = []
    for u in units:
        if staged[u.index]:
            sets.append(u.param_bytes)  # the forward read
    for u in reversed(units):
        i = u.index
        ws = u.table_bytes if staged[i] else 0
        if offloaded[i]:
            ws += u.input_bytes
        if (u.backward == "explicit" and u.needs_output and i < last
                and offloaded[i + 1]):
            ws += units[i + 1].input_bytes
        sets.append(ws)
    return sets


def _evaluate(sequence, staged, offloaded):
    """(device total, pool, peak working set, resident, activations,
    tapes)."""
    units = sequence.units
    peak = max(_working_sets(sequence, staged, offloaded), default=0)
    pool = 2 * peak
    resident = sequence.fixed_bytes + sum(
        u.table_bytes for u in units if u.has_params and not staged[u.index])
    first = sequence.first_with_params
    kept = sum(u.input_bytes for u in units[first:]
               if not offloaded[u.index])
    moved = [u.input_bytes if offloaded[u.index] else 0 for u in units]
    # On its way out an offloaded activation is still on the device while
    # the next layer runs on the next one and produces the one after.
    flight = max((sum(moved[i:i + 3]) for i in range(len(moved))),
                 default=0)
    activations = max(kept + sequence.output_bytes + flight,
                      sequence.early_peak())
    tapes = sum(_tape(units, i, staged, offloaded, first)
                for i in range(len(units)))
    return (resident + pool + activations + tapes, pool, peak, resident,
            activations, tapes)


def _tape(units, i, staged, offloaded, first):
    """The estimate of what unit i's kept tape holds: its output when it
    is taped (see `_modes`; the trainer keeps no tape before the first
    layer with parameters, `first`: nothing there needs a gradient),
    else 0."""
    u = units[i]
    if (i < first or u.backward == "explicit" or staged[i] or offloaded[i]
            or (i + 1 < len(units) and offloaded[i + 1])):
        return 0
    return u.output_bytes


def _traffic(sequence, staged, offloaded):
    total = 0
    for u in sequence.units:
        if staged[u.index]:  # in for forward, in and out for backward
            total += u.param_bytes + 2 * u.table_bytes
        if offloaded[u.index]:
            total += 2 * u.input_bytes
    return total


def _modes(sequence, staged, offloaded):
    units = sequence.units
    first = sequence.first_with_params
    modes = []
    for u in units:
        i = u.index
        if i < first:  # no gradient reaches it: no backward at all
            modes.append("none")
        elif u.backward == "explicit":
            modes.append("explicit")
        elif staged[i] or offloaded[i] or (i + 1 < len(units)
                                           and offloaded[i + 1]):
            # A kept tape would pin the parameters, the input or the
            # output on the device: recompute from the saved input instead.
            modes.append("recompute")
        else:
            modes.append("taped")
    return modes


# ------------------------------------------------------------ the search
def _offload_policy(sequence, offload_activations):
    names = [u.name for u in sequence.units]
    first = sequence.first_with_params
    if offload_activations is None or offload_activations is False:
        return set(), set()
    units = sequence.units
    if offload_activations == "auto":
        # Only inputs kept for the backward pass can wait on the host, and
        # only those the swap ops can copy.
        return set(), {i for i in range(first, len(names))
                       if units[i].offloadable}
    if isinstance(offload_activations, str):
        offload_activations = [offload_activations]
    if not isinstance(offload_activations, (list, tuple)) or not all(
            isinstance(name, str) for name in offload_activations):
        raise TypeError(f"offload_activations must be None, \"auto\" or a "
                        f"list of layer names, not {offload_activations!r}")
    forced = set()
    for name in offload_activations:
        if name not in names:
            raise ValueError(f"offload_activations names {name!r}, which is "
                             f"no layer of the model (layers: {names})")
        index = names.index(name)
        if index < first:
            raise ValueError(
                f"offload_activations names {name!r}, which comes before "
                f"the first layer with parameters "
                f"({names[first] if first < len(names) else 'none'}): no "
                "gradient reaches it, so its input is never kept for the "
                "backward pass and there is nothing to offload")
        if not units[index].offloadable:
            raise ValueError(
                f"offload_activations names {name!r}, whose input is "
                f"{units[index].input_dtype}: the swap ops copy only "
                f"{', '.join(SWAPPABLE_DTYPES)} tensors, so it cannot wait "
                "in host memory")
        forced.add(index)
    return forced, set(forced)


class _Search:
    """The device total of a plan, updated move by move in O(1).

    Moves only ever take an item off the device, so the peak working set
    and the activations in flight only grow: running maxima suffice; a
    move can only turn a taped layer into a recomputed one (its tape's
    estimate leaves the total).
    """

    def __init__(self, sequence, forced):
        units = sequence.units
        self.units = units
        self.last = len(units) - 1
        self.staged = [False] * len(units)
        self.offloaded = [i in forced for i in range(len(units))]
        self.resident = sequence.fixed_bytes + sum(
            u.table_bytes for u in units if u.has_params)
        self.first = sequence.first_with_params
        self.kept = sum(u.input_bytes for u in units[self.first:]
                        if not self.offloaded[u.index])
        self.output = sequence.output_bytes
        self.early = sequence.early_peak()
        ws = _working_sets(sequence, self.staged, self.offloaded)
        self.peak = max(ws, default=0)
        self.flight = max((self._window(i) for i in range(len(units))),
                          default=0)
        self.tapes = sum(self._tape(i) for i in range(len(units)))

    def _tape(self, i):
        return _tape(self.units, i, self.staged, self.offloaded,
                     self.first) if i >= 0 else 0

    def _window(self, i):
        return sum(self.units[j].input_bytes
                   for j in range(max(0, i), min(len(self.units), i + 3))
                   if self.offloaded[j])

    def _backward_ws(self, i):
        u = self.units[i]
        ws = u.table_bytes if self.staged[i] else 0
        if self.offloaded[i]:
            ws += u.input_bytes
        if (u.backward == "explicit" and u.needs_output and i < self.last
                and self.offloaded[i + 1]):
            ws += self.units[i + 1].input_bytes
        return ws

    @property
    def total(self):
        return (self.resident + 2 * self.peak + self.tapes
                + max(self.kept + self.output + self.flight, self.early))

    def stage(self, i, limit):
        """Stages table i if no working set then exceeds `limit`."""
        tape = self._tape(i)
        self.staged[i] = True
        ws = max(self.units[i].param_bytes, self._backward_ws(i))
        if ws > limit:
            self.staged[i] = False
            return False
        self.peak = max(self.peak, ws)
        self.resident -= self.units[i].table_bytes
        self.tapes -= tape - self._tape(i)
        return True

    def offload(self, i, limit):
        """Offloads activation i if no working set then exceeds `limit`."""
        tapes = self._tape(i - 1) + self._tape(i)
        self.offloaded[i] = True
        ws = max(self._backward_ws(j) for j in (i - 1, i) if j >= 0)
        if ws > limit:
            self.offloaded[i] = False
            return False
        self.peak = max(self.peak, ws)
        self.kept -= self.units[i].input_bytes
        self.flight = max([self.flight] + [self._window(j)
                                           for j in range(i - 2, i + 1)])
        self.tapes -= tapes - self._tape(i - 1) - self._tape(i)
        return True


def _greedy(sequence, budget, limit, forced, allowed):
    """Stages tables, then offloads activations, in first-access order,
    while the device total exceeds `budget`, never letting a working set
    exceed `limit`. Returns (staged, offloaded, total) or None."""
    search = _Search(sequence, forced)
    if search.peak > limit:
        return None
    units = sequence.units
    for move, candidates in (
            (search.stage, [u.index for u in units if u.has_params]),
            (search.offload, sorted(allowed - forced))):
        for i in candidates:
            if budget is None or search.total <= budget:
                break
            move(i, limit)
    return search.staged, search.offloaded, search.total


def _limits(sequence):
    """Every working-set size a plan could have: the candidate pool halves."""
    units = sequence.units
    values = {0}
    for i, u in enumerate(units):
        nxt = units[i + 1].input_bytes if i + 1 < len(units) else 0
        for table in {0, u.param_bytes, u.table_bytes}:
            for act in {0, u.input_bytes}:
                for out in {0, nxt}:
                    values.add(table + act + out)
    return sorted(values)


def check_budget(budget, name="budget"):
    """Returns `budget` in whole bytes.

    Args:
        budget: a device memory budget in bytes.
        name: what to call it in the error. Defaults to "budget".

    Raises:
        ValueError: it is not a number (or is a bool), not finite, or not
            positive.
    """
    if isinstance(budget, bool) or not isinstance(budget, numbers.Real) \
            or not math.isfinite(budget) or int(budget) <= 0:
        raise ValueError(f"{name} must be a positive number of bytes, not "
                         f"{budget!r}")
    return int(budget)


def plan(sequence, budget=None, offload_activations=None):
    """Plans the device memory of the recorded step under a budget.

    Args:
        sequence: the step's `AccessSequence` (see `record_model`).
        budget: device bytes the parameter cache, the non-trainable
            variables (frozen layers, BatchNorm statistics; never staged),
            the access pool, the saved activations and the kept tapes (an
            estimate: see the module's docstring) may use. Defaults to
            None: no limit, every table resident.
        offload_activations: None (default) keeps every activation on the
            device; "auto" lets the planner offload them, first layers
            first, when the tables alone cannot make the plan fit; a list
            of layer names offloads exactly those.

    Returns:
        A `MemoryPlan`.

    The search is greedy (O(layers^2)): for each pool size it stages
    tables, then offloads activations, in first-access order while the
    total exceeds the budget. It is not exhaustive: rarely, a plan it does
    not reach fits a budget below its `minimum_budget` (e.g. offloading a
    later activation alone where taking an earlier one first enlarges the
    pool and keeps the later one out); naming the activations in
    `offload_activations` then reaches it.

    Raises:
        MemoryBudgetError: the budget is below the smallest total the
            search finds (`minimum_budget`).

    Example:

    ```python
    seq = record_model(model, batch_size=32)
    p = plan(seq, budget=64 << 20)
    print(p)                       # one row per table and activation
    p.pool_bytes == 2 * p.peak_working_set
    ```
    """
    if budget is not None:
        budget = check_budget(budget)
    forced, allowed = _offload_policy(sequence, offload_activations)
    minimum = None
    best = None
    for limit in _limits(sequence):
        # The smallest total with this pool: everything that may move, moved.
        lowest = _greedy(sequence, -1, limit, forced, allowed)
        if lowest is None:
            continue
        if minimum is None or lowest[2] < minimum:
            minimum = lowest[2]
        result = _greedy(sequence, budget, limit, forced, allowed)
        if result is None or (budget is not None and result[2] > budget):
            continue
        staged, offloaded, total = result
        key = (_traffic(sequence, staged, offloaded), total)
        if best is None or key < best[0]:
            best = (key, staged, offloaded)
    if best is None:
        raise MemoryBudgetError(budget, minimum)
    return MemoryPlan(sequence, budget, best[1], best[2], minimum)
