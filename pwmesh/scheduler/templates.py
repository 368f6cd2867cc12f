"""The templates an island scheduler holds: cached lowerings installed once, run by id (no sockets).

A program run again and again (its lowering cached by the proxy: program x slice version) is
installed here once (``InstallTemplate``: each executor's part, packed, with the devices it uses);
each run is then one ``RunTemplate`` with the run's buffer names. The scheduler orders it by the
template's footprint, computed once, and sends each executor an ``Enqueue`` naming the template
and carrying the run's names; the part's bytes go only with the first run an executor is sent
(an executor that lost them asks again: ``NeedTemplate``, answered with ``InstallPart``).

A run of a template not held here (this scheduler restarted, or evicted it) is refused whole,
before anything of it is ordered: the proxy is told (``TemplateMissing``) and installs it again.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

from pwmesh.errors import InvalidArgument
from pwmesh.wire.messages import InstallPart, InstallTemplate, NeedTemplate, RunPart
from pwmesh.wire.records import MAX_DEVICES

DeviceKey = tuple[str, int]  # (executor_id, device)
MAX_TEMPLATES = 1024  # templates held per island (the least recently run dropped first)
MAX_TEMPLATE_ID_CHARS = 64


@dataclasses.dataclass(eq=False)
class Template:
    template_id: str
    parts: list[RunPart]
    footprint: frozenset[DeviceKey]  # every (executor, device) its runs use
    names: int  # how many names a run must carry (its parts' refs point below)
    sent: set[str] = dataclasses.field(default_factory=set)  # executors sent their part
    # Executor -> its nodes, and every node in order: what its runs' completions are counted by (``completions.py``).
    executor_nodes: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    nodes: list[int] = dataclasses.field(default_factory=list)
    # Where each part's computations start in a run's sequence numbers (and, last, how many there are), and
    # the parts as the order's history keeps them: the same for every run.
    offsets: list[int] = dataclasses.field(default_factory=list)
    placed: list[tuple[str, list[int]]] = dataclasses.field(default_factory=list)
    layout: Any = None  # its runs' fan-out tree (``tree.Layout``), once worked out by the scheduler's core
    places: Any = None  # its executors' places in the order's counts (``order.ExecutorCounts``), once worked out

    def __post_init__(self) -> None:
        self.offsets = [0]
        for part in self.parts:
            self.offsets.append(self.offsets[-1] + len(part.nodes))
        self.placed = [(part.executor_id, part.nodes) for part in self.parts]

    @property
    def held_by_all(self) -> bool:
        """Whether every executor of it holds its part (its runs carry only their names)."""
        return len(self.sent) == len(self.parts)

    @classmethod
    def of(cls, msg: InstallTemplate) -> Template:
        """The template ``msg`` installs, checked: device ranges an executor could hold, one part per executor."""
        if not msg.template_id or len(msg.template_id) > MAX_TEMPLATE_ID_CHARS:
            raise InvalidArgument(f"a template id has 1 to {MAX_TEMPLATE_ID_CHARS} characters")
        seen: set[str] = set()
        for part in msg.parts:
            if part.executor_id in seen:
                raise InvalidArgument(f"template {msg.template_id}: two parts for {part.executor_id}")
            seen.add(part.executor_id)
            if any(r < 0 for r in part.refs):
                raise InvalidArgument(f"template {msg.template_id}: a negative name reference")
            for r in part.devices:
                if r.first < 0 or not 1 <= r.count <= MAX_DEVICES:
                    raise InvalidArgument(f"template {msg.template_id}: devices [{r.first}, +{r.count}) "
                                          f"on {part.executor_id}")
        footprint = frozenset((part.executor_id, r.first + k) for part in msg.parts for r in part.devices
                              for k in range(r.count))
        names = max((r + 1 for part in msg.parts for r in part.refs), default=0)
        executor_nodes = {part.executor_id: list(part.nodes) for part in msg.parts}
        nodes = sorted({n for part in msg.parts for n in part.nodes})
        return cls(msg.template_id, list(msg.parts), footprint, names, executor_nodes=executor_nodes, nodes=nodes)


class IslandTemplates:
    """The island's installed templates by id (the newest ``capacity``), and which executors hold their parts."""

    def __init__(self, capacity: int = MAX_TEMPLATES) -> None:
        self.capacity = capacity
        self._templates: collections.OrderedDict[str, Template] = collections.OrderedDict()
        self.controls: dict[str, str] = {}  # executor -> its control address, as the templates name it

    def __len__(self) -> int:
        return len(self._templates)

    def install(self, msg: InstallTemplate) -> Template:
        """Keep ``msg``'s template (again: the same id is the same parts; what executors hold stays)."""
        template = self._templates.get(msg.template_id)
        if template is None:
            template = self._templates[msg.template_id] = Template.of(msg)
            for part in template.parts:
                self.controls[part.executor_id] = part.control
            while len(self._templates) > self.capacity:
                self._templates.popitem(last=False)
        self._templates.move_to_end(msg.template_id)
        return template

    def get(self, template_id: str) -> Template | None:
        template = self._templates.get(template_id)
        if template is not None:
            self._templates.move_to_end(template_id)
        return template

    def forget_executor(self, executor_id: str) -> None:
        """A new process runs under ``executor_id``: it holds no part (its next run carries them again)."""
        for template in self._templates.values():
            template.sent.discard(executor_id)

    def part_for(self, msg: NeedTemplate) -> tuple[str, InstallPart]:
        """Where to send the executor that asks its part, and the answer: the part, or why it cannot have it."""
        template = self._templates.get(msg.template_id)
        part = None if template is None else next((p for p in template.parts if p.executor_id == msg.executor_id),
                                                   None)
        if template is None or part is None:
            control = self.controls.get(msg.executor_id, msg.control)
            return control, InstallPart(template_id=msg.template_id, missing=(
                f"the island's scheduler no longer holds template {msg.template_id} (it restarted, or dropped "
                f"it as the least recently run of {self.capacity}); the run fails: run the program again"))
        template.sent.add(msg.executor_id)
        return part.control, InstallPart(template_id=msg.template_id, nodes=part.nodes,
                                         computations=part.computations, refs=part.refs)
