"""Pipeline parallelism (``pipeline_parallel_size``): the schedules' facts, the options' refusals, the split of a
model into stages, the gradients a step hands to the loss's backward, the recipe's checks before workers start,
and (slow) Trainer and Fabric runs against plain npu_fsdp with as many data-parallel replicas
(tests/parallel/scripts/pipeline_run.py)."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_npu.facts import pipeline as facts
from lightning_npu.facts.options import FSDPOptions
from lightning_npu.parallel import ParallelPlan, PipelineLayout
from lightning_npu.parallel.context import apply_context_parallel
from lightning_npu.parallel.pipeline import _PipelineLoss, _StepGradients, split
from recipes.decoder.tensor_parallel import PIPELINE
from tests.helpers import REPO

# ---------------------------------------------------------------------------------------------- schedules (facts)


@pytest.mark.parametrize("blocks, stages, expected", [
    (8, 4, [[0], [1, 2, 3], [4, 5, 6], [7]]),  # the embedding and the head count as a block each
    (4, 2, [[0, 1], [2, 3]]),
    (4, 4, [[], [0, 1], [2, 3], []]),  # end stages of the embedding or the head alone
    (6, 1, [[0, 1, 2, 3, 4, 5]]),
])
def test_blocks_spread_over_stages_every_block_once_in_order(blocks, stages, expected):
    assert facts.blocks_per_stage(blocks, stages) == expected


@pytest.mark.parametrize("schedule", ["ZBVZeroBubble", "DualPipeV"])
@pytest.mark.parametrize("blocks, pp", [(8, 2), (6, 2), (4, 2), (7, 3), (32, 4), (5, 4)])
def test_a_v_schedule_gives_every_rank_an_equal_share_of_the_blocks(schedule, blocks, pp):
    """Rank 0 holds both end stages of a V, so the loop rule's lighter ends would make it the lighter rank
    (benchmarks/pipeline_bubble.py: 8 blocks as 1, 3, 3, 1 idled rank 0 for 60% of a ZBV step; 2, 2, 2, 2 ran it
    in 28% less time). Every rank's two stages hold blocks // pp or one more, the extra ones on the last ranks."""
    split = facts.blocks_per_stage(blocks, 2 * pp, schedule=schedule)
    assert [index for stage in split for index in stage] == list(range(blocks))
    shares = [len(split[rank]) + len(split[2 * pp - 1 - rank]) for rank in range(pp)]
    assert shares == sorted(shares) and max(shares) - min(shares) <= 1 and sum(shares) == blocks


def test_too_few_blocks_for_the_stages_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="2 blocks do not spread over 8 pipeline stages.*use fewer stages"):
        facts.blocks_per_stage(2, 8)
    # A V with fewer blocks than ranks would leave a rank nothing to train (its optimizer refuses an empty list
    # there while the other ranks wait in their next collective).
    with pytest.raises(ValueError, match="3 blocks do not spread over the 4 ranks of a V-shaped pipeline"):
        facts.blocks_per_stage(3, 8, schedule="ZBVZeroBubble")


@pytest.mark.parametrize("schedule, rank, expected", [
    ("1F1B", 1, (1,)), ("Interleaved1F1B", 1, (1, 3)), ("ZBVZeroBubble", 0, (0, 3)), ("ZBVZeroBubble", 1, (1, 2)),
])
def test_each_schedule_places_its_stages(schedule, rank, expected):
    per_rank = facts.stages_per_rank(schedule, None)
    assert facts.stage_ids(schedule, rank, 2, per_rank) == expected
    # the loss is computed where the last stage (3 of 4, or 1 of 2) sits
    assert facts.last_stage_rank(schedule, 2, per_rank) == (0 if schedule == "ZBVZeroBubble" else 1)


def test_microbatch_rules_of_torchs_constructors_are_checked():
    with pytest.raises(ValueError, match="needs at least as many microbatches as stages"):
        facts.check_microbatches("1F1B", 1, 2, 1)
    facts.check_microbatches("GPipe", 1, 2, 1)
    assert facts.bubble_fraction("1F1B", 4, 12) == pytest.approx(3 / 15)
    assert facts.bubble_fraction("ZBVZeroBubble", 4, 8) == 0.0


# ---------------------------------------------------------------------------------------------- options


@pytest.mark.parametrize("options, refused", [
    (dict(pipeline_schedule="ZBVZeroBubble", activation_checkpointing_policy=["Block"]),
     "activation_checkpointing_policy"),
])
def test_what_pipeline_parallelism_cannot_run_with_is_refused_at_construction(options, refused):
    with pytest.raises(ValueError, match=rf"pipeline_parallel_size=2 does not run with .*{refused}"):
        FSDPOptions(pipeline_parallel_size=2, **options)


def test_pipeline_options_that_run():
    options = FSDPOptions(pipeline_parallel_size=2, tensor_parallel_size=2, context_parallel_size=2,
                          pipeline_schedule="Interleaved1F1B", activation_checkpointing_policy=["Block"])
    assert options.stages_per_rank == 2 and options.microbatches == 4  # default: one microbatch per stage
    assert options.layout(1, 16).sizes == {"pp": 2, "dp_replicate": 1, "dp_shard": 2, "cp": 2, "tp": 2}
    with pytest.raises(ValueError, match="pipeline_schedule='Pipedream' is not one of"):
        FSDPOptions(pipeline_parallel_size=2, pipeline_schedule="Pipedream")


# ---------------------------------------------------------------------------------------------- the split


def _tiny_llama(n_layers: int = 4):
    from recipes.decoder.module import DecoderLM

    torch.manual_seed(0)
    lm = DecoderLM(preset="tiny", config={"n_layers": n_layers, "max_seq_len": 16})
    lm.configure_model()
    return lm.model


def test_stages_chained_in_one_process_give_the_models_loss_and_keep_parameter_names():
    model = _tiny_llama()
    tokens, labels = torch.randint(0, 2048, (2, 16)), torch.randint(0, 2048, (2, 16))
    labels[0, :5] = -100
    expected = model(tokens, labels=labels)
    first, last = split(copy.deepcopy(model), PIPELINE, [0], 2), split(copy.deepcopy(model), PIPELINE, [1], 2)
    assert first.blocks == [[0, 1], [2, 3]]
    assert first.module.output is None and first.module.norm is None and last.module.tok_embeddings is None
    names = {name for part in (first, last) for name, _ in part.module.named_parameters()}
    assert names == {name for name, _ in model.named_parameters()}
    hidden = first.stages[0](tokens)
    assert hidden.shape == (2, 16, model.config.dim)
    torch.testing.assert_close(last.stages[1](hidden, labels=labels), expected, rtol=0, atol=0)


def test_what_the_plan_sets_after_the_split_reaches_every_stage_and_nothing_is_pushed_into_the_holder():
    """Each stage is a module of its own that parallelize applies the plan to, rooted at it (ParallelPlan.within):
    what the plan sets after the split (context parallelism here; a TP style or a flag alike) is on every stage the
    schedule runs, a block's on the stage holding it; the modules outside every stage keep their part of the plan
    (ParallelPlan.outside: the LightningModule, which shards the batch), and the pruned holder gets nothing."""
    from recipes.decoder.module import DecoderLM

    torch.manual_seed(0)
    lm = DecoderLM(preset="tiny", config={"n_layers": 4, "max_seq_len": 16})
    lm.configure_model()
    plan = dataclasses.replace(lm.parallel_plan(), context_parallel=("", "model", "model.layers.1.attention",
                                                                     "model.layers.2.attention"))
    known = {name for name, _ in lm.named_modules()}
    split_ = split(lm.model, PIPELINE, [0, 1], 2)
    marker = object()  # what apply_context_parallel gives: a ContextParallel, here any object
    rooted = {index: plan.within("model", stage, known) for index, stage in split_.stages.items()}
    assert {index: part.context_parallel for index, part in rooted.items()} == {
        0: ("", "layers.1.attention"), 1: ("", "layers.2.attention")}
    for index, stage in split_.stages.items():
        assert apply_context_parallel(stage, rooted[index].context_parallel, marker) == list(
            rooted[index].context_parallel)
    first, last = split_.stages[0], split_.stages[1]
    assert first is not last and first is not split_.module
    assert first.context_parallel is marker and last.context_parallel is marker
    assert first.layers[1].attention.context_parallel is marker and last.layers[2].attention.context_parallel is marker
    assert "context_parallel" not in vars(split_.module)
    assert plan.outside("model").context_parallel == ("",)


def test_a_model_that_does_not_fit_its_layout_is_refused_by_name():
    model = _tiny_llama(2)
    with pytest.raises(ValueError, match=r"names \['head'\], which LLaMA has no child called"):
        split(model, PipelineLayout("", ("tok_embeddings",), "layers", ("head",)), [0], 2)
    model.extra = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"\['extra'\] hold parameters but are in no part of the pipeline layout"):
        split(model, PIPELINE, [0], 2)


def test_a_users_model_split_in_one_process_gives_its_loss_with_its_keyword_inputs_and_buffers():
    """The user's model of tests/parallel/scripts/pipeline_user_model.py (a root buffer used by the first stage, a keyword
    mask used by the last): its two stages chained give the whole model's loss, and a stage whose forward does not
    skip the parts it lacks fails naming them and the fix, not with Python's "'NoneType' object is not callable"."""
    from tests.parallel.scripts.pipeline_user_model import SEQ, SequenceClassifier, Sequences

    torch.manual_seed(0)
    model, batch = SequenceClassifier(), Sequences(4, seed=1)[:]
    layout = PipelineLayout("", ("project",), "blocks", ("norm", "head"))
    expected = model(batch["x"], labels=batch["labels"], mask=batch["mask"])
    first, last = split(copy.deepcopy(model), layout, [0], 2), split(copy.deepcopy(model), layout, [1], 2)
    hidden = first.stages[0](batch["x"], mask=batch["mask"])
    output = last.stages[1](hidden, mask=batch["mask"])
    torch.testing.assert_close(last.module.loss(output, batch["labels"]), expected, rtol=0, atol=0)

    class Unaware(SequenceClassifier):  # written for one device only: calls every part
        def forward(self, x, *, labels=None, mask=None):
            h = self.project(x * self.feature_scale)
            for block in self.blocks:
                h = block(h)
            return self.head(self.norm(h).mean(1))

    torch.manual_seed(0)
    stage = split(Unaware(), layout, [0], 2).stages[0]
    with pytest.raises(TypeError, match=r"Unaware.forward failed on a pipeline stage that does not hold"
                                        r" \['norm', 'head'\] \('NoneType' object is not callable\).*if self.head"
                                        r" is None, return h"):
        stage(torch.randn(2, SEQ, 8))


class _Tied(nn.Module):
    """Its embedding (first stage) is its head (last stage)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.blocks = nn.Embedding(8, 4), nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.head = nn.Linear(4, 8, bias=False)
        self.head.weight = self.embed.weight

    def loss(self, output, labels, reduction="mean"):
        return nn.functional.cross_entropy(output, labels, reduction=reduction)


def _unsplittable(problem: str) -> nn.Module:
    """A user's model (tests/parallel/scripts/pipeline_user_model.py) changed so that it cannot be split: ``problem``."""
    from tests.parallel.scripts.pipeline_user_model import SequenceClassifier

    model = SequenceClassifier()
    if problem == "loss":
        model.loss = lambda logits, labels: nn.functional.cross_entropy(logits, labels)  # no reduction
    elif problem == "sequential":
        model.blocks = nn.Sequential(*model.blocks)
    elif problem == "own parameter":
        model.position = nn.Parameter(torch.zeros(8))
    elif problem == "few blocks":
        model.blocks = model.blocks[:1]
    elif problem == "no loss":
        model = nn.ModuleDict(dict(project=model.project, blocks=model.blocks, norm=model.norm, head=model.head))
    else:
        model = _Tied()
    return model


_REFUSALS = {
    "loss": r"SequenceClassifier.loss\(logits, labels\) cannot be called as loss\(output, labels,"
            r" reduction='sum'\).*give loss a reduction argument",
    "sequential": r"blocks \(SequenceClassifier.blocks\) are a Sequential: .* make them an nn.ModuleList",
    "own parameter": r"SequenceClassifier holds parameters of its own \(\['position'\]\).*move them into a part",
    "few blocks": r"1 blocks do not spread over 4 pipeline stages.*use fewer stages",
    "no loss": r"ModuleDict has no loss\(output, labels, reduction\) method.*define it",
    "tied": r"_Tied.embed.weight \(stage 0\) and .head.weight \(stage 3\) are one parameter.*make them two parameters",
}


@pytest.mark.parametrize("problem", list(_REFUSALS))
def test_a_user_model_that_cannot_be_split_is_refused_before_workers_start(problem, simulate, monkeypatch):
    """trainer.fit under pipeline_parallel_size=2 (4 stages: Interleaved1F1B) on 2 simulated NPUs: the model's
    problem is raised with the value, the reason and the fix in the launching process, before Lightning starts
    the other rank."""
    from lightning.pytorch import Trainer
    from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

    from lightning_npu import NPUFSDPStrategy
    from tests.parallel.scripts.pipeline_user_model import Classify

    def started(*args, **kwargs):
        raise AssertionError("Lightning started the other ranks before the model was checked")

    monkeypatch.setattr(_SubprocessScriptLauncher, "_call_children_scripts", started)
    simulate(2)
    lm = Classify()
    lm.model = _unsplittable(problem)
    if problem == "tied":
        lm.parallel_plan = lambda: ParallelPlan(pipeline=PipelineLayout("model", ("embed",), "blocks", ("head",)))
    strategy = NPUFSDPStrategy(pipeline_parallel_size=2, pipeline_schedule="Interleaved1F1B")
    trainer = Trainer(accelerator="npu", devices=2, strategy=strategy, max_steps=1, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises((ValueError, TypeError), match=_REFUSALS[problem]):
        trainer.fit(lm)


# ---------------------------------------------------------------------------------------------- the step's gradients


def test_the_losss_backward_adds_the_steps_gradients_times_what_it_brings():
    """What a Lightning closure does: training_step (the schedule computed these gradients), zero_grad, then
    backward of loss / accumulate_grad_batches: the parameter ends with exactly the step's gradient / 2."""
    param = nn.Parameter(torch.zeros(3))
    param.grad = torch.tensor([1.0, 2.0, 3.0])  # the step's, computed inside the schedule
    gradients = _StepGradients([param])
    param.grad = torch.full((3,), 5.0)  # an earlier step's, which zero_grad clears
    loss = _PipelineLoss.apply(torch.ones((), requires_grad=True), torch.tensor(4.0), gradients)
    assert loss.item() == 4.0 and loss.requires_grad
    param.grad = None
    (loss / 2).backward()
    torch.testing.assert_close(param.grad, torch.tensor([0.5, 1.0, 1.5]))
    earlier = nn.Parameter(torch.zeros(2))
    earlier.grad = torch.ones(2)
    held = _StepGradients([earlier])
    earlier.grad = torch.full((2,), 3.0)  # accumulated from an earlier batch of the window: kept and added to
    _PipelineLoss.apply(torch.ones((), requires_grad=True), torch.tensor(1.0), held).backward()
    torch.testing.assert_close(earlier.grad, torch.full((2,), 4.0))


def test_a_short_evaluation_batch_is_padded_with_unlabelled_rows_only_where_labels_can_say_so(monkeypatch):
    """The last evaluation batch of 3 rows and 4 microbatches: integer labels get a padding row of -100 (no loss);
    float labels (a regression loss) would count -100 as a target, silently, so the batch is refused with the fix."""
    from lightning_npu.parallel.pipeline import Pipeline

    pipeline = Pipeline.__new__(Pipeline)  # the decision alone: no stages, no process group
    pipeline.microbatches, pipeline._shapes, pipeline._with_loss = 4, None, True
    with torch.no_grad():
        x, labels, _ = pipeline._check_shapes(torch.zeros(3, 5), torch.ones(3, 5, dtype=torch.int64), {})
        assert x.shape == (4, 5) and labels[3].tolist() == [-100] * 5 and labels[:3].eq(1).all()
        with pytest.raises(ValueError, match=r"its labels are torch.float32: .*divide by it, or drop_last=True"):
            pipeline._check_shapes(torch.zeros(3, 5), torch.zeros(3), {})


def test_the_strict_fake_refuses_the_p2p_batch_hccl_refuses_and_passes_the_rest(monkeypatch):
    """Importing torch_npu aliases ``batch_isend_irecv`` to its own; under the fake that one refuses two sends (or two
    receives) to one peer before any exchange, as HcclBatchSendRecv does, and hands a send and a receive per peer
    (1F1B's pattern on 2 ranks) to torch."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from tests.npu_fake import install_fake_torch_npu

    handed = []
    monkeypatch.setattr(dist.distributed_c10d, "batch_isend_irecv", handed.append)
    install_fake_torch_npu(monkeypatch)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=3)  # P2POp resolves its peer in a group
    try:
        x = torch.zeros(2)
        with pytest.raises(RuntimeError, match="repeats send to/from rank 1"):
            dist.batch_isend_irecv([dist.P2POp(dist.isend, x, 1), dist.P2POp(dist.isend, x.clone(), 1)])
        with pytest.raises(ValueError, match="P2POp"):
            dist.batch_isend_irecv([x])
        assert handed == []
        ops = [dist.P2POp(dist.isend, x, 1), dist.P2POp(dist.irecv, x.clone(), 1), dist.P2POp(dist.isend, x, 2)]
        dist.batch_isend_irecv(ops)
        assert handed == [ops]
    finally:
        dist.destroy_process_group()


def test_the_recipes_module_refuses_what_a_pipeline_cannot_split_when_built_by_a_script():
    """train.py checks the model before workers start; a script that builds DecoderLM itself gets the same reasons
    from configure_model (every rank alike). Before, the MoE load-balancing loss under pp 2 failed at the first
    backward with torch's "Trying to backward through the graph a second time"."""
    from types import SimpleNamespace

    from lightning_npu.facts.options import FSDPOptions
    from recipes.decoder.module import DecoderLM

    lm = DecoderLM(family="moe", preset="tiny", config={"router_aux_loss_coef": 0.01})
    lm._trainer = SimpleNamespace(strategy=SimpleNamespace(options=FSDPOptions(pipeline_parallel_size=2)))
    with pytest.raises(ValueError, match="pipeline_parallel_size=2 cannot run this model: model.config.router_aux_"):
        lm.configure_model()
    lm._trainer = SimpleNamespace(strategy=SimpleNamespace(options=FSDPOptions()))
    lm.configure_model()
    assert lm.model is not None


def test_a_full_checkpoint_under_pp_refuses_a_param_group_out_of_the_models_order(monkeypatch):
    """A full file numbers each group's parameters; under a pipeline every rank holds part of each group, and only the
    model's order puts the parts back together, while without the pipeline the optimizer's own order numbers them.
    A group listed otherwise (head before embedding) would put the moments on other parameters when loaded without
    the pipeline: refused on every rank. Sharded saves, which key the state by name, are not affected."""
    import torch.distributed as dist

    from lightning_npu.strategies.checkpoints.optimizer_state import whole_param_groups

    ranks = [[["embed.weight", "blocks.0.w"]], [["head.weight", "blocks.1.w"]]]  # rank 1 lists the head first
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_gather_object", lambda out, obj, group=None: out.__setitem__(slice(None), ranks))
    order = ["embed.weight", "blocks.0.w", "blocks.1.w", "head.weight"]
    state = {"state": {}, "param_groups": [{"lr": 0.1, "params": ranks[0][0]}]}
    with pytest.raises(ValueError, match="param group 0 lists 'blocks.1.w' after 'head.weight', against the model"):
        whole_param_groups(state, order, None, numbered=True)
    assert whole_param_groups(state, order, None)["param_groups"][0]["params"] == order
    ranks[1] = [["blocks.1.w", "head.weight"]]
    assert whole_param_groups(state, order, None, numbered=True)["param_groups"][0]["params"] == order


# ---------------------------------------------------------------------------------------------- the recipe's checks


def _check(config: dict | None = None, data: str = "text", batch_size: int = 8, family: str = "llama", **options):
    from types import SimpleNamespace

    from recipes.decoder.data import TextDataModule
    from recipes.decoder.module import DecoderLM
    from recipes.decoder.sft_data import SFTDataModule
    from recipes.train import check_parallel_layout

    model = DecoderLM(family=family, preset="tiny", config=config or {})
    data_module = (TextDataModule if data == "text" else SFTDataModule)(batch_size=batch_size, seq_len=32)
    strategy = SimpleNamespace(options=FSDPOptions(pipeline_parallel_size=2, pipeline_microbatches=4, **options))
    check_parallel_layout(model, data_module, SimpleNamespace(strategy=strategy))


@pytest.mark.parametrize("config, data, batch_size, family, problem", [
    ({"tie_embeddings": True}, "text", 8, "llama", "tie_embeddings=true: the embedding"),
    ({"mtp_layers": 1}, "text", 8, "deepseek", "mtp_layers=1: multi-token prediction"),
    ({"router_aux_loss_coef": 0.01}, "text", 8, "moe", "router_aux_loss_coef=0.01: the load-balancing loss"),
    ({}, "sft", 8, "llama", r"data \(SFTDataModule\) packs samples"),
    ({}, "text", 6, "llama", "data.batch_size=6 does not split into pipeline_microbatches=4"),
])
def test_what_the_stages_cannot_split_is_refused_before_workers_start(config, data, batch_size, family, problem):
    with pytest.raises(ValueError, match=rf"pipeline_parallel_size=2 cannot run this model: .*{problem}"):
        _check(config, data, batch_size, family)


def test_too_few_blocks_for_the_stages_are_refused_before_workers_start():
    with pytest.raises(ValueError, match="1 blocks do not spread over 4 pipeline stages"):
        _check({"n_layers": 1}, pipeline_schedule="Interleaved1F1B")


def test_a_model_and_data_the_stages_split_pass():
    _check({"n_layers": 4})
    _check({"n_layers": 4, "router_aux_loss_coef": 0.0}, family="moe")  # no load-balancing loss term


# ---------------------------------------------------------------------------------------------- runs (slow)


def _close(runs: dict, name: str, reference: str, key: str = "losses", start: int = 0) -> None:
    run, expected = torch.tensor(runs[name][key]), torch.tensor(runs[reference][key][start:])
    assert len(run) == len(expected) > 0, (name, key)
    torch.testing.assert_close(run, expected, rtol=0, atol=1e-5, msg=lambda m: f"{name} {key} vs {reference}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("name, reference", [
    ("pp2", "plain"),  # 1F1B, 2 epochs, a checkpoint after the first
    ("pp2_gpipe", "plain_epoch"), ("pp2_interleaved", "plain_epoch"), ("pp2_zbv", "plain_epoch"),
    ("pp2_accumulate", "plain_accumulate"),  # 2 batches a step: the backward's 1 / 2 scales the step's gradients
    ("pp2_dp2", "plain2"),  # pp 2 x 2 replicas against 2 replicas
    ("moe_pp2", "moe_plain"),  # the routing bias moves by the tokens routed on each stage's MoE layers
    ("moe_pp2_ep2", "moe_plain2"),  # each stage's experts split over the 2 replicas, exchanged per microbatch
    ("qwen3_pp2", "qwen3_plain"), ("deepseek_pp2", "deepseek_plain"),  # q/k norms; MLA and DeepSeekMoE
    ("deepseek_pp2_tp2", "deepseek_plain"),  # MLA's plan, sequence parallel: the stages exchange sequence halves
    # context parallelism inside the stages: each rank's loss its share of the group's labelled tokens' mean
    ("pp2_cp2_ring", "plain_epoch"), ("pp2_cp2_ulysses", "plain_epoch"),
    ("user_pp2", "user_plain"),  # a user's LightningModule: its own parts, blocks of x alone, a keyword mask, loss
])
def test_pipeline_trains_and_validates_with_the_losses_of_plain_sharding(pipeline_runs, name, reference):
    """Every schedule, gradient accumulation, data parallelism, an MoE, Qwen3 and DeepSeek (also under tensor and
    sequence parallelism), context parallelism (ring under ZBV, Ulysses) under pipeline_parallel_size 2 and a user's
    own LightningModule against plain npu_fsdp with as many data-parallel replicas, from the same first weights and rows (30 % of labels
    -100, so the microbatches hold unequal label counts), gradients clipped at 1.0 (the norm over every stage):
    per-step training losses and every epoch's validation loss (its last batch of 3 rows padded to the 4
    microbatches) within 1e-5; the loss falls. torch sent no point-to-point batch HCCL would refuse."""
    _close(pipeline_runs, name, reference)
    _close(pipeline_runs, name, reference, "val")
    losses = pipeline_runs[name]["losses"]
    assert sum(losses[-2:]) < sum(losses[:2]) - 0.1
    assert pipeline_runs[name]["refused_by_hccl"] == []


@pytest.mark.slow
def test_a_checkpoint_resumes_across_pipeline_layouts(pipeline_runs):
    """Plain npu_fsdp's sharded checkpoint after epoch 0 resumed under pp 2, and pp 2's under plain and under pp 2 x
    tensor parallelism 2 (sequence parallelism and loss_parallel, npu_fsdp's defaults: the second stage receives
    each sequence's halves and gives its rotary the whole sequence's positions): the second epoch's losses and
    validation are plain's, within 1e-5.
    Parameter names and the optimizer's param groups are the whole model's in every layout."""
    for name in ("plain_to_pp2", "pp2_to_plain", "pp2_to_pp2_tp2"):
        _close(pipeline_runs, name, "plain", start=5)
        _close(pipeline_runs, name, "plain", "val", start=1)


@pytest.mark.slow
def test_a_lora_run_trains_under_pp_and_resumes_from_its_adapters(pipeline_runs):
    """LoRA on every projection of the first weights (the base frozen, from init_from): under pp 2 the losses of
    plain npu_fsdp; pp 2's sharded checkpoint of adapters resumed under pp 2, and plain's full file of adapters
    resumed under plain, continue as the uninterrupted run. Before, a stage's load checked its adapters against the
    whole model's (missing: the other stage's), and a full file of adapters failed the raw load's check against
    every base weight."""
    _close(pipeline_runs, "lora_pp2", "lora_plain")
    _close(pipeline_runs, "lora_pp2", "lora_plain", "val")
    for name in ("lora_pp2_to_pp2", "lora_full_to_plain"):
        _close(pipeline_runs, name, "lora_plain", start=5)
        _close(pipeline_runs, name, "lora_plain", "val", start=1)


@pytest.mark.slow
def test_a_full_checkpoint_under_pp_holds_every_stage_and_resumes_under_pp_and_plain(pipeline_runs):
    """``state_dict_type="full"`` under pp 2: one file after epoch 0 with the whole model in its parameter order and
    the optimizer's state numbered as plain numbers it, what consolidating pp 2's sharded checkpoint gives (the same
    run); resumed under pp 2 and under plain, the second epoch is plain's; pp 2 x 2 replicas writes such a file
    too, which resumes its run.
    Catches a file of rank 0's stage only, and a load that broadcasts rank 0's tensors to the other stage (wrong
    weights, or a hang)."""
    from lightning_npu.strategies.checkpoints.offline import read_sharded

    plain = pipeline_runs["plain"]
    runs = {**pipeline_runs, "plain_first_epoch": {"losses": plain["losses"][:5], "val": plain["val"][:1]}}
    _close(runs, "pp2_full", "plain_first_epoch")  # its first epoch only: it stops after saving
    _close(runs, "pp2_full", "plain_first_epoch", "val")
    for name in ("pp2_full_to_pp2", "pp2_full_to_plain"):
        _close(pipeline_runs, name, "plain", start=5)
        _close(pipeline_runs, name, "plain", "val", start=1)
    out = Path(pipeline_runs["out"])
    full, sharded = torch.load(out / "pp2_full_epoch0", weights_only=False), read_sharded(out / "pp2_epoch0")
    assert list(full["state_dict"]) == [name for name, _ in _tiny_llama().named_parameters(prefix="model")]
    torch.testing.assert_close(full["state_dict"], sharded["state_dict"], rtol=0, atol=1e-6)
    (full_optimizer,), (sharded_optimizer,) = full["optimizer_states"], sharded["optimizer_states"]
    assert full_optimizer["param_groups"] == sharded_optimizer["param_groups"]
    torch.testing.assert_close(full_optimizer["state"], sharded_optimizer["state"], rtol=0, atol=1e-6)
    # pp 2 x 2 replicas: its second stage sent to rank 0 tensor by tensor from rank 2 while rank 3, which holds the
    # same stage, makes each whole with it. The file holds what pp 2's does, and resumed it continues the run as if
    # it had not stopped.
    replicated = torch.load(out / "pp2_dp2_full_epoch0", weights_only=False)
    assert list(replicated["state_dict"]) == list(full["state_dict"])
    assert replicated["optimizer_states"][0]["param_groups"] == full_optimizer["param_groups"]
    _close(pipeline_runs, "pp2_dp2_full_to_pp2_dp2", "pp2_dp2", start=5)
    _close(pipeline_runs, "pp2_dp2_full_to_pp2_dp2", "pp2_dp2", "val", start=1)


@pytest.mark.slow
def test_a_fabric_loop_written_for_one_device_runs_pipelined(pipeline_runs):
    """``loss = model(x, labels=y)``, ``fabric.backward(loss / 2)`` over 2 batches, ``fabric.clip_gradients``: the
    same losses under pp 2 as on one device, within 1e-5."""
    _close(pipeline_runs, "fabric_pp2", "fabric_plain")


@pytest.mark.slow  # reads the pipeline launches
def test_fabric_load_raw_of_a_full_file_gives_each_stage_its_tensors(pipeline_runs):
    """``fabric.load_raw(file, model)`` after training puts the first weights back: the first batch's loss is then
    the first step's, under pp 2 as without. Lightning's own raw load broadcasts rank 0's tensors, which under a
    pipeline are its stage's only (the other stage's ranks wait for tensors that never come)."""
    for name in ("fabric_plain", "fabric_pp2"):
        run = pipeline_runs[name]
        assert run["reloaded_first_loss"] == pytest.approx(run["losses"][0], abs=1e-6), name


@pytest.mark.slow
@pytest.mark.parametrize("name", ["predict_pp2", "predict_pp2_zbv", "predict_cp2", "predict_pp2_cp2"])
def test_predict_returns_the_last_stages_logits_on_every_rank(pipeline_runs, name):
    """``trainer.predict`` whose ``predict_step`` calls the module without labels: under pp 2 (1F1B, and the V
    schedule, whose last stage is on rank 0) every rank returns the batch's logits, those plain npu_fsdp gives, the
    last batch of 3 rows too (padded to the 4 microbatches, cut back). Under context parallelism (cp 2 Ulysses; pp 2 x
    cp 2 ring) each rank runs its part of every sequence and the whole logits are gathered: before, the module gave
    each rank's whole rows to the model as that rank's part, whose positions then ran to 64 for 32 tokens (refused
    here by max_seq_len 32; with a longer max_seq_len, wrong logits)."""
    out = Path(pipeline_runs["out"])
    plain = torch.load(out / "predict_plain_rank0.pt")
    assert pipeline_runs[name]["batches"] == pipeline_runs["predict_plain"]["batches"] == [[4, 32, 2048], [4, 32, 2048],
                                                                                          [3, 32, 2048]]
    for rank in range(pipeline_runs[name]["ranks"]):
        torch.testing.assert_close(torch.load(out / f"{name}_rank{rank}.pt"), plain, rtol=0, atol=1e-5,
                                   msg=lambda m: f"{name} rank {rank}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["predict_plain", "predict_pp2"])
def test_npu_fsdp_evaluates_under_no_grad_whatever_the_trainer_says(pipeline_runs, name):
    """FSDP2's first unshard under inference_mode on a one-rank shard group (pipeline or tensor parallelism without
    data parallelism, one device) fails ("Inference tensors do not track version counter"), and Lightning picks
    inference_mode for every backend but gloo: on HCCL ``trainer.predict`` from a fresh Trainer would fail where the
    simulation (gloo: no_grad) passes. So the decision is tested: with ``Trainer(inference_mode=True)`` npu_fsdp
    turns every evaluation loop's inference_mode off, as Lightning does for its FSDPStrategy."""
    assert pipeline_runs[name]["loops_inference_mode"] == [False] * 4
    assert pipeline_runs[name]["predict_step_inference_mode"] is False


@pytest.mark.slow
def test_a_nan_the_first_stage_alone_sees_skips_and_stops_every_rank_as_plain(pipeline_runs):
    """NonFiniteLossGuard(max_skipped_steps=2) under pp 2 and plain with the same NaNs (tests/parallel/scripts/pipeline_run.py
    ``Poison``): block 0's output at step 1, global rank 0's loss at step 2 (under pp 2 after the broadcast, so the
    last stage's rank sees a finite loss), a block 0 gradient at step 3 (every loss finite; clipping's norm over
    the stages turns every weight NaN, and step 4's loss). Every rank skips steps 1 and 2 and stops at step 4 with
    plain's error, with plain's losses. Catches a per-rank decision: rank 1 would apply step 2, which plain skips
    (its losses would differ; its skips too), and ranks raising at different steps would hang in the next
    collective."""
    plain, pp = pipeline_runs["guard_plain"], pipeline_runs["guard_pp2"]
    (expected,) = plain["ranks"]
    assert expected["skipped"] == [1, 2]
    assert expected["stopped"].startswith("NonFiniteLossError: The training loss was NaN or Inf at step 4 "
                                          "(trainer.global_step) after skipping steps [1, 2];")
    assert pp["ranks"] == [expected, expected]
    torch.testing.assert_close(torch.tensor(pp["losses"]), torch.tensor(plain["losses"]), rtol=0, atol=1e-5,
                               equal_nan=True)
    assert len(plain["losses"]) == 4 and torch.tensor(plain["losses"]).isnan().tolist() == [False, True, True, False]


@pytest.mark.slow
def test_a_preemption_one_rank_sees_stops_every_stage_at_one_step_with_a_checkpoint_of_every_stage(pipeline_runs):
    """SIGTERM to global rank 1 alone (the last stage) at step 2 of a pp 2 run saving on preemption: both ranks raise
    Preempted at step 2 naming one checkpoint, which holds every stage's weights, as each rank held them, and the
    optimizer's state of every parameter; the losses before it are plain's. A per-rank decision would leave rank 0
    training while rank 1 saves: the run would hang (the launch's timeout) instead."""
    from lightning_npu.strategies.checkpoints.offline import read_sharded

    run = pipeline_runs["preempt_pp2"]
    first, last = run["ranks"]
    expected = f"Preempted: preempted by SIGTERM at step 2; checkpoint {run['checkpoint']}"
    assert first["stopped"] == last["stopped"] == expected
    assert first["difference"] == last["difference"] == 0.0  # each stage's weights, as saved
    checkpoint = read_sharded(run["checkpoint"])
    assert not set(first["held"]) & set(last["held"])
    assert set(checkpoint["state_dict"]) == set(first["held"]) | set(last["held"])
    (optimizer,) = checkpoint["optimizer_states"]
    assert sorted(optimizer["state"]) == list(range(len(checkpoint["state_dict"]))) and checkpoint["global_step"] == 2
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(pipeline_runs["plain_epoch"]["losses"][:2]),
                               rtol=0, atol=1e-5)


@pytest.mark.slow
def test_a_checkpoint_written_under_pp_consolidates_exports_and_generates_as_one_written_without(pipeline_runs,
                                                                                              tmp_path, capsys):
    """pp 2's sharded checkpoint after epoch 0, and the same weights written by plain npu_fsdp (resumed from it and
    saved before its first step): ``lightning-npu consolidate`` gives equal files (weights, the optimizer's state
    and param groups numbered alike), ``recipes/convert.py to-hf`` equal HF directories, and ``recipes/generate.py``
    the same text from the directory, the file and the HF export."""
    from safetensors.torch import load_file

    from lightning_npu.cli import main as cli
    from recipes.convert import main as convert
    from recipes.generate import main as generate

    out = Path(pipeline_runs["out"])
    written = {}
    for name in ("pp2_epoch0", "pp2_weights_plain"):
        assert cli(["consolidate", str(out / name), str(tmp_path / f"{name}.ckpt")]) == 0
        assert convert(["to-hf", str(tmp_path / f"{name}.ckpt"), str(tmp_path / f"{name}_hf")]) == 0
        checkpoint = torch.load(tmp_path / f"{name}.ckpt", weights_only=False)
        texts = []
        for source in (out / name, tmp_path / f"{name}.ckpt", tmp_path / f"{name}_hf"):
            capsys.readouterr()
            assert generate([str(source), "--prompt", "Once upon a time", "--max-new-tokens", "12", "--temperature",
                             "0", "--device", "cpu", "--tokenizer", str(REPO / "recipes/assets/tokenizer")]) == 0
            texts.append(capsys.readouterr().out)
        written[name] = (checkpoint, load_file(tmp_path / f"{name}_hf" / "model.safetensors"), texts)
    (pp, pp_hf, pp_texts), (plain, plain_hf, plain_texts) = written.values()
    assert pp["state_dict"].keys() == plain["state_dict"].keys() and len(pp["state_dict"]) == 39
    assert all(torch.equal(pp["state_dict"][key], plain["state_dict"][key]) for key in plain["state_dict"])
    (pp_optimizer,), (plain_optimizer,) = pp["optimizer_states"], plain["optimizer_states"]
    assert pp_optimizer["param_groups"] == plain_optimizer["param_groups"]
    assert pp_optimizer["state"].keys() == plain_optimizer["state"].keys()
    for index, state in plain_optimizer["state"].items():
        assert all(torch.equal(pp_optimizer["state"][index][key], value) for key, value in state.items())
    assert pp_hf.keys() == plain_hf.keys() and all(torch.equal(pp_hf[key], plain_hf[key]) for key in plain_hf)
    assert pp_texts == plain_texts and len(set(pp_texts)) == 1 and pp_texts[0].startswith("Once upon a time")


def test_an_optimizer_made_before_the_split_forgets_the_other_stages_parameters():
    """``fabric.setup(model, optimizer)`` with an optimizer of the whole model: the parameters a split removed from
    this rank leave its param groups and state (they would be stepped and saved here otherwise)."""
    from lightning_npu.strategies.rebind import ReplacedParameters

    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    optimizer = torch.optim.AdamW(model.parameters())
    for param in model.parameters():  # the state a step leaves
        optimizer.state[param] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros_like(param)}
    before = ReplacedParameters.before(model)
    kept = list(model[0].parameters())
    model[1] = nn.Identity()  # another stage's
    replaced = ReplacedParameters()
    replaced.record(model, before)
    replaced.rebind(optimizer)
    assert optimizer.param_groups[0]["params"] == kept and list(optimizer.state) == kept


def test_pretrained_weights_are_checked_against_the_models_keys(tmp_path):
    from recipes.decoder.pretrained import check_keys

    model = _tiny_llama(2)
    state = dict(model.state_dict())
    check_keys(model, state, distributed=False)
    state["layers.7.attention.wq.weight"] = state.pop("layers.1.attention.wq.weight")
    with pytest.raises(RuntimeError, match=r"missing key\(s\) \['layers.1.attention.wq.weight'\], unexpected key\(s\)"
                                           r" \['layers.7.attention.wq.weight'\]"):
        check_keys(model, state, distributed=False)


def test_the_private_stage_methods_the_pipeline_wraps_exist_in_this_torch():
    """parallel.pipeline marks the stages' shape inference (so an MoE layer does not count its tokens) and stops the
    V schedules' input-gradient hand-off in evaluation through these torch 2.13 methods: a torch without them must
    fail here, not count wrong or crash mid-run."""
    from torch.distributed.pipelining import PipelineStage

    for name in ("_forward_metadata_inference", "get_local_bwd_output", "set_local_bwd_input"):
        assert callable(getattr(PipelineStage, name, None)), name


def test_an_explicit_count_of_blocks_per_stage_replaces_the_rule():
    model = _tiny_llama()
    part = split(model, PIPELINE, [1], 2, layers_per_stage=[1, 3])
    assert part.blocks == [[0], [1, 2, 3]] and [name for name, _ in part.module.layers.named_children()] == ["1", "2", "3"]
    with pytest.raises(ValueError, match=r"pipeline_layers_per_stage=\[1, 2\] holds 3 blocks, but the model has 4"):
        facts.blocks_per_stage(4, 2, layers_per_stage=[1, 2])
    with pytest.raises(ValueError, match=r"pipeline_layers_per_stage=\[1, 3\] gives 2 stages, but the pipeline has 4"):
        FSDPOptions(pipeline_parallel_size=2, pipeline_schedule="Interleaved1F1B", pipeline_layers_per_stage=[1, 3])
    with pytest.raises(ValueError, match="must be a list of block counts"):
        FSDPOptions(pipeline_parallel_size=2, pipeline_layers_per_stage="1,3")
    with pytest.raises(ValueError, match=r"holds 3 blocks, but the model has 4"):
        _check({"n_layers": 4}, pipeline_layers_per_stage=[1, 2])
