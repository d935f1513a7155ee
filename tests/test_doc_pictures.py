"""The parallelism page's pictures (``tools/generate_docs.py``): the mesh drawn from ``MeshLayout`` and each pipeline
schedule's timeline drawn from ``lightning_npu.facts.pipeline.replay``. They say what the code does (every rank in
the boxes of its coordinates; every action of every rank, in torch's order, at the replay's times), and the page
goes stale, failing ``tests/test_docs.py``, when the code changes under them."""

from __future__ import annotations

import re
import shutil

import pytest

from lightning_npu.facts.options import MeshLayout
from lightning_npu.facts.pipeline import COSTS, actions, replay, stages_per_rank
from tests.helpers import REPO
from tools.generate_docs import BLOCKS, MESH_EXAMPLE, TIMELINES, mesh_block, stale, timeline


def test_the_mesh_diagram_puts_every_rank_in_the_boxes_of_its_coordinates():
    layout = MeshLayout(**MESH_EXAMPLE)
    diagram = mesh_block().split("```mermaid\n")[1].split("```")[0]
    boxes: list[str] = []
    placed = {}
    for line in diagram.splitlines():
        line = line.strip()
        if opened := re.fullmatch(r'subgraph \S+\["(\w+) = (\d+)"\]', line):
            boxes.append(f"{opened[1]}={opened[2]}")
        elif line == "end":
            boxes.pop()
        elif node := re.fullmatch(r'r(\d+)\["rank \1<br>(\w+) = (\d+)"\]', line):
            placed[int(node[1])] = [*boxes, f"{node[2]}={node[3]}"]
    assert not boxes and sorted(placed) == list(range(layout.world_size))
    for rank, where in placed.items():
        assert where == [f"{name}={value}" for name, value in layout.coordinates(rank).items()
                         if layout.sizes[name] > 1], rank


@pytest.mark.parametrize("schedule", list(TIMELINES))
def test_each_timeline_row_is_the_ranks_actions_in_order_at_the_replays_times(schedule):
    pp, microbatches = TIMELINES[schedule]
    per_rank = stages_per_rank(schedule)
    rows = timeline(schedule, pp, microbatches).splitlines()
    assert len(rows) == pp
    for rank, (row, timed) in enumerate(zip(rows, replay(schedule, pp, microbatches, per_rank))):
        cells = row.split(" | ", 1)[1].split()
        drawn, tick = [], 0
        while tick < len(cells):  # each computation: its label over as many ticks as it costs
            if cells[tick] == ".":
                tick += 1
                continue
            span = int(COSTS[cells[tick][0].upper()])
            assert cells[tick:tick + span] == [cells[tick]] * span, (rank, tick)
            drawn.append((tick, cells[tick]))
            tick += span
        order = actions(schedule, rank, pp, microbatches, per_rank)
        assert [label.upper() for _, label in drawn] == [f"{kind}{mb}" for _, kind, mb in order]
        assert [start for start, _ in drawn] == [int(item.start) for item in timed]
        first = order[0].stage
        assert [label.isupper() for _, label in drawn] == [stage == first for stage, _, _ in order]


def test_a_timeline_changed_by_hand_makes_the_page_stale(tmp_path):
    for page in {page for page, _ in BLOCKS.values()}:
        (tmp_path / page).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / page, tmp_path / page)
    assert stale(tmp_path) == []
    page = tmp_path / "docs" / "parallelism.md"
    text = page.read_text()
    edited = text.replace("rank 0 | F0 F1", "rank 0 | F1 F0", 1)
    assert edited != text
    page.write_text(edited)
    assert stale(tmp_path) == ["docs/parallelism.md (schedules)"]
