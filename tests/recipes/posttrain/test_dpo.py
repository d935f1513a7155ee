"""DPO (recipes/posttrain): preference rows tokenised as TRL 1.16 tokenises them, each loss as TRL defines it, the
reference under LoRA, bad input refused before workers start, and the recipe's per-step losses equal to TRL's
DPOTrainer on the same model and rows (trl, from the test extra, is the oracle)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from recipes.decoder.data import DEFAULT_TOKENIZER
from recipes.decoder.checkpoint_layout import read_model_tensors, read_recipe_metadata
from recipes.decoder.lora import is_adapter_name
from recipes.decoder.lora_config import LoRAConfig
from recipes.models.llama.config import LLaMAConfig
from recipes.models.llama.model import LLaMA
from recipes.posttrain.dpo import DPOLM
from recipes.posttrain.reference import adapters_off
from recipes.posttrain.dpo_loss import pair_losses
from recipes.posttrain.logprobs import token_logprobs
from recipes.posttrain.preference_data import PreferenceDataModule, collate_preferences, to_preference
from recipes.decoder.sft_data import BadSampleError
from tests.helpers import REPO, room_scripts, run_python
from tests.hf_models import random_hf_model, with_random_adapters
from tests.recipe_runs import last_checkpoint, logged_losses
from tests.recipes.test_e2e import STRATEGY, _assert_fails_before_workers

SCRIPTS = room_scripts("recipes/posttrain")

TRAIN_DPO = str(REPO / "recipes/posttrain/train_dpo.py")
TINY_DPO = str(REPO / "recipes/models/llama/configs/tiny_dpo.yaml")
STANDARD_ROWS = [
    {"prompt": "Which module defines Path?\n", "chosen": "pathlib", "rejected": "os.path"},
    {"prompt": "Name a sorting function.", "chosen": " sorted</s>", "rejected": " list.sort"},  # EOS already there
    {"prompt": "Say hi", "chosen": " hi there, friend", "rejected": "!"},  # tokens may merge across the boundary
]
CONVERSATIONAL_ROWS = [
    {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Which module defines Path?"}],
     "chosen": [{"role": "assistant", "content": "pathlib"}],
     "rejected": [{"role": "assistant", "content": "os.path, of course"}]},
    {"prompt": [{"role": "user", "content": "Name a sorting function."}],
     "chosen": [{"role": "assistant", "content": "sorted"}], "rejected": [{"role": "assistant", "content": "min"}]},
]
# A ChatML-like template that, like Qwen's, emits no BOS and ends a turn with its own marker.
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _our_rows(tmp_path: Path, rows: list[dict], tokenizer: str, max_length: int = 64) -> list[dict]:
    data = PreferenceDataModule(path=str(_write_rows(tmp_path / "rows.jsonl", rows)), tokenizer=tokenizer,
                                seq_len=max_length, batch_size=1, cache_dir=str(tmp_path / "cache"))
    data.setup()
    rows = [data.train_dataset[i] for i in range(len(data.train_dataset))]
    assert [row.pop("index") for row in rows] == list(range(len(rows)))
    return rows


def _trl_rows(rows: list[dict], tokenizer_path: str, tmp_path: Path, max_length: int = 64) -> list[dict]:
    """TRL 1.16's own ``DPOTrainer._prepare_dataset`` (called on a bare instance: it reads only ``_tokenizer``)."""
    import datasets
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    config = DPOConfig(output_dir=str(tmp_path / "trl"), max_length=max_length, use_cpu=True, report_to="none")
    trainer = SimpleNamespace(_tokenizer=tokenizer)
    prepared = DPOTrainer._prepare_dataset(trainer, datasets.Dataset.from_list(rows), tokenizer, config, "train")
    return [{key: row[key] for key in ("prompt_ids", "chosen_ids", "rejected_ids")} for row in prepared]


def test_standard_rows_tokenize_and_collate_as_trl(tmp_path):
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    ours, theirs = _our_rows(tmp_path, STANDARD_ROWS, DEFAULT_TOKENIZER), _trl_rows(STANDARD_ROWS, DEFAULT_TOKENIZER,
                                                                                   tmp_path)
    assert ours == theirs
    assert all(row["chosen_ids"][-1] == 1 and row["chosen_ids"].count(1) == 1 for row in ours)  # one EOS (id 1)
    expected = DataCollatorForPreference(pad_token_id=1, max_length=8)(theirs)
    batch = collate_preferences(ours, pad_id=1, max_length=8)
    assert torch.equal(batch["input_ids"], expected["input_ids"])
    assert torch.equal(batch["completion_mask"], expected["completion_mask"])


def test_conversational_rows_tokenize_with_the_chat_template_as_trl(tmp_path):
    tokenizer = tmp_path / "tokenizer"
    shutil.copytree(DEFAULT_TOKENIZER, tokenizer)
    config = json.loads((tokenizer / "tokenizer_config.json").read_text())
    (tokenizer / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    ours = _our_rows(tmp_path, CONVERSATIONAL_ROWS, str(tokenizer))
    assert ours == _trl_rows(CONVERSATIONAL_ROWS, str(tokenizer), tmp_path)
    assert all(row["chosen_ids"][-2:] == [1, ours[0]["chosen_ids"][-1]] for row in ours)  # "</s>\n", no EOS added


def test_conversational_row_without_prompt_takes_the_shared_messages_as_trl():
    from trl.data_utils import extract_prompt

    whole = {name: CONVERSATIONAL_ROWS[0]["prompt"] + CONVERSATIONAL_ROWS[0][name] for name in ("chosen", "rejected")}
    assert to_preference(dict(whole)) == extract_prompt(dict(whole)) == CONVERSATIONAL_ROWS[0]


@pytest.mark.parametrize("loss_type", ["sigmoid", "hinge", "ipo"])
def test_each_loss_is_trls_formula(loss_type):
    beta, chosen, rejected = 0.1, torch.tensor([2.0, -1.0, 30.0]), torch.tensor([-3.0, 4.0, 1.0])
    chosen_tokens, rejected_tokens = torch.tensor([4, 2, 5]), torch.tensor([1, 3, 5])
    formulas = {  # TRL 1.16 dpo_trainer.py, per pair
        "sigmoid": lambda c, r, nc, nr: -math.log(1 / (1 + math.exp(-beta * (c - r)))),
        "hinge": lambda c, r, nc, nr: max(0.0, 1 - beta * (c - r)),
        "ipo": lambda c, r, nc, nr: (c / nc - r / nr - 1 / (2 * beta)) ** 2,
    }
    expected = [formulas[loss_type](*values) for values in zip(chosen.tolist(), rejected.tolist(),
                                                               chosen_tokens.tolist(), rejected_tokens.tolist())]
    got = pair_losses(loss_type, beta, chosen, rejected, chosen_tokens, rejected_tokens)
    torch.testing.assert_close(got, torch.tensor(expected), rtol=1e-6, atol=1e-6)


def test_token_logprobs_are_the_targets_log_softmax_and_zero_where_unlabelled():
    logits = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([[4, -100, 0], [-100, 2, 1]])
    expected = torch.where(labels == -100, 0.0,
                           logits.log_softmax(-1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1))
    torch.testing.assert_close(token_logprobs(logits, labels), expected)


def test_adapters_off_gives_the_base_models_logits_and_restores_the_adapters():
    config = LLaMAConfig.from_preset("tiny", n_layers=2)
    torch.manual_seed(0)
    model = LLaMA(config).eval()
    ids = torch.randint(0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base = model(ids)
        with_random_adapters(model, LoRAConfig(rank=4, alpha=8, targets=("q", "v", "down")), seed=2, std=0.2)
        adapted = model(ids)
        with adapters_off(model):
            off = model(ids)
        again = model(ids)
    assert (adapted - base).abs().max() > 1e-2  # the adapters change the logits
    torch.testing.assert_close(off, base, rtol=0, atol=1e-6)
    torch.testing.assert_close(again, adapted, rtol=0, atol=0)


def test_a_preference_row_without_chosen_stops_preparation_naming_its_line(tmp_path):
    rows = _write_rows(tmp_path / "rows.jsonl", [STANDARD_ROWS[0], {"prompt": "Hi", "rejected": "no"}])
    data = PreferenceDataModule(path=str(rows), cache_dir=str(tmp_path / "cache"))
    with pytest.raises(BadSampleError, match=r"line 2 of .*rows.jsonl: 'chosen' is missing: a preference row needs"):
        data.prepare()


@pytest.mark.parametrize(("row", "message"), [
    ({"prompt": "Hi", "chosen": "yes", "rejected": ["no"]}, "'rejected' is a list where 'chosen' is a string"),
    ({"chosen": "Hi yes", "rejected": "Hi no"}, "'prompt' is missing: a standard (text) preference row needs"),
    ({"prompt": "Hi", "chosen": "", "rejected": "no"}, "'chosen' is empty"),
])
def test_malformed_preference_rows_are_refused_with_the_reason(row, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        to_preference(row)


def test_conversational_rows_need_a_chat_template(tmp_path):
    rows = _write_rows(tmp_path / "rows.jsonl", CONVERSATIONAL_ROWS)
    data = PreferenceDataModule(path=str(rows), cache_dir=str(tmp_path / "cache"))  # the tiny tokenizer has none
    with pytest.raises(BadSampleError, match="has no chat template to render it"):
        data.prepare()


def test_dpo_options_are_checked_when_the_module_is_built():
    with pytest.raises(ValueError, match="loss_type='kto' is not one of sigmoid, ipo, hinge"):
        DPOLM(loss_type="kto")
    with pytest.raises(ValueError, match="beta=0 must be > 0"):
        DPOLM(beta=0)
    with pytest.raises(ValueError, match="reference='adapters_off' needs model.lora"):
        DPOLM(reference="adapters_off")
    assert DPOLM().reference_kind == "copy"


# ------------------------------------------------------------------------------------------------ slow
_SHAPE = {"vocab_size": 2048, "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden_dim": 96,
          "max_seq_len": 128, "norm_eps": 1e-5, "rope_theta": 10000.0}
_HF_SHAPE = {"vocab_size": 2048, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "intermediate_size": 96, "max_position_embeddings": 128, "rms_norm_eps": 1e-5,
             "rope_theta": 10000.0}
_STEPS, _BATCH = 10, 4


@pytest.fixture(scope="module")
def dpo_case(tmp_path_factory):
    """A tiny random LLaMA saved as HF, 40 preference rows, and TRL 1.16 DPOTrainer's losses on them (batch 4,
    fp32, AdamW at a constant 1e-4 without weight decay or clipping, beta 0.1, sigmoid, rows in order)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("dpo_case")
    random_hf_model(LlamaConfig, LlamaForCausalLM, _HF_SHAPE).save_pretrained(root / "hf")
    rows = (REPO / "recipes/assets/preferences.jsonl").read_text().splitlines(keepends=True)[:_STEPS * _BATCH]
    (root / "rows.jsonl").write_text("".join(rows))
    run_python([str(SCRIPTS / "trl_dpo_losses.py"), str(root / "hf"), DEFAULT_TOKENIZER, str(root / "rows.jsonl"),
                str(root / "trl.json"), "--batch", str(_BATCH), "--steps", str(_STEPS), "--lr", "1e-4"], simulate=None)
    return root, json.loads((root / "trl.json").read_text())


def _train_dpo(root: Path, case: Path, npus: int, *extra: str):
    """``train_dpo.py fit`` of tiny_dpo.yaml on the case's model and rows, every step logged, into ``root``."""
    return run_python([TRAIN_DPO, "fit", "--config", TINY_DPO, "--model.config", json.dumps(_SHAPE),
                       "--model.init_from", str(case / "hf"), "--data.path", str(case / "rows.jsonl"),
                       "--data.cache_dir", str(root / "cache"), "--trainer.devices", str(npus),
                       "--trainer.log_every_n_steps", "1", "--trainer.enable_progress_bar", "false",
                       "--trainer.default_root_dir", str(root / "run"), *extra], simulate=npus)


@pytest.mark.slow
@pytest.mark.parametrize(("npus", "reference"), [(1, "copy"), (2, "precomputed")])
def test_dpo_per_step_losses_equal_trl_dpo_trainer(tmp_path, dpo_case, npus, reference):
    """Catches any difference from TRL in the tokens (EOS, the prompt split, truncation), the log-probs (the shift,
    the mask), the reference (a live frozen copy on 1 NPU; on 2, the log-probs precomputed when the fit starts, each
    rank scoring a share: a row read at the wrong index moves the loss far past 1e-4 once the policy has moved), the
    loss and its mean over the data-parallel ranks, and the optimizer step."""
    case, trl_losses = dpo_case
    _train_dpo(tmp_path, case, npus, "--model.precompute_reference", str(reference == "precomputed").lower(),
               "--data.shuffle", "false", "--data.batch_size", str(_BATCH // npus),
               "--data.val_fraction", "0", "--trainer.max_steps", str(_STEPS), "--trainer.gradient_clip_val", "null",
               "--trainer.limit_val_batches", "0")
    ours = logged_losses(tmp_path / "run", 0)
    assert len(trl_losses) == _STEPS and sorted(ours) == list(range(_STEPS))
    assert max(abs(loss - math.log(2)) for loss in trl_losses) > 3e-3  # the policy moved off its reference
    assert max(abs(ours[step] - trl_losses[step]) for step in range(_STEPS)) < 1e-4, (ours, trl_losses)
    if reference == "precomputed":  # kept in checkpoints, so a resume reads the same log-probs
        tables = read_recipe_metadata(last_checkpoint(tmp_path / "run", 0))["dpo_reference_logps"]
        assert tables["train"].shape == (_STEPS * _BATCH, 2) and (tables["train"] < 0).all()


@pytest.mark.slow
def test_dpo_resumed_mid_epoch_reproduces_uninterrupted_losses(tmp_path, dpo_case):
    """The uninterrupted run keeps its step-4 checkpoint, and one more launch resumes from it (two launches, not a
    crash and a resume beside the uninterrupted run: the checkpoint is the same state): the shuffled data position,
    the LR schedule, the policy, its optimizer and the frozen reference copy (from the checkpoint) all come back, so
    steps 4 to 7 repeat the uninterrupted run's losses."""
    case, _ = dpo_case
    schedule = ["--data.batch_size", "2", "--data.val_fraction", "0.1", "--trainer.max_steps", "8",
                "--trainer.val_check_interval", "4", "--trainer.limit_val_batches", "1", "--model.learning_rate",
                "1e-3"]
    mid = tmp_path / "mid"
    _train_dpo(tmp_path / "full", case, 2, *schedule, "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
               "--trainer.callbacks.dirpath", str(mid), "--trainer.callbacks.every_n_train_steps=4",
               "--trainer.callbacks.save_top_k=-1")
    _train_dpo(tmp_path / "resumed", case, 2, *schedule, "--ckpt_path", str(mid / "epoch=0-step=4.ckpt"))
    full, resumed = logged_losses(tmp_path / "full" / "run", 0), logged_losses(tmp_path / "resumed" / "run", 0)
    assert sorted(full) == list(range(8)) and sorted(resumed) == list(range(4, 8))
    assert max(abs(full[step] - math.log(2)) for step in range(4, 8)) > 1e-2  # the policy is off its reference
    assert [resumed[step] for step in range(4, 8)] == pytest.approx([full[step] for step in range(4, 8)], rel=1e-5)


@pytest.mark.slow
def test_qlora_dpo_with_8bit_adamw_takes_the_base_as_reference_and_checkpoints_the_adapters_only(tmp_path, dpo_case):
    """Under LoRA (here QLoRA: the base stored NF4, with 8-bit AdamW, one launch for the three) the reference is the
    policy with its adapters off: at the first step (B = 0) the policy is its reference (loss log 2, zero rewards),
    the adapters then move it, and the checkpoint holds no second model."""
    import csv

    case, _ = dpo_case
    _train_dpo(tmp_path, case, 2, "--model.lora",
               "{rank: 4, alpha: 8, dropout: 0.0, targets: [q, v, down], base_quantization: nf4}",
               "--model.optimizer", "adamw8bit", "--model.learning_rate", "1e-2", "--data.batch_size", "2", "--data.val_fraction", "0",
               "--trainer.max_steps", "6", "--trainer.limit_val_batches", "0")
    losses = logged_losses(tmp_path / "run", 0)
    with open(tmp_path / "run" / "lightning_logs" / "version_0" / "metrics.csv") as metrics:
        first = next(row for row in csv.DictReader(metrics) if row.get("train_loss"))
    assert losses[0] == pytest.approx(math.log(2), abs=1e-6)
    assert float(first["rewards/chosen"]) == float(first["rewards/rejected"]) == 0.0
    assert abs(losses[5] - math.log(2)) > 1e-3
    _, state = read_model_tensors(last_checkpoint(tmp_path / "run", 0))
    assert state and all(is_adapter_name(name) for name in state), sorted(state)[:5]


@pytest.mark.slow
@pytest.mark.parametrize(("args", "message"), [
    ([STRATEGY + "pipeline_parallel_size", "2"], "DPO scores every sequence with the policy and the reference"),
    ([STRATEGY + "context_parallel_size", "2"], "context_parallel_size=2: DPO sums each completion's log-probs whole"),
], ids=["pipeline", "context"])
def test_pipeline_and_context_parallel_dpo_fail_before_workers_start(tmp_path, args, message):
    _assert_fails_before_workers(tmp_path, lambda: run_python(
        [TRAIN_DPO, "fit", "--config", TINY_DPO, "--data.cache_dir", str(tmp_path / "cache"), "--trainer.max_steps",
         "2", "--trainer.default_root_dir", str(tmp_path / "run"), *args]), message)
