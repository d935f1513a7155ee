"""Train or fine-tune a decoder LM of any model family of the recipe with LightningCLI (``model.family``, one of
``recipes/families.py``; the config's family folder, ``recipes/models/<family>/configs``, holds its configs).

    python recipes/train.py fit --config recipes/models/llama/configs/tiny.yaml
    LIGHTNING_NPU_SIMULATE=2 python recipes/train.py fit --config recipes/models/llama/configs/tiny.yaml
    python recipes/train.py prepare --config recipes/models/llama/configs/llama2_7b.yaml --data.tokenize_num_proc 32
    torchrun --nproc-per-node 8 recipes/train.py fit --config recipes/models/llama/configs/llama2_7b.yaml
    python recipes/train.py fit --config recipes/models/llama/configs/tiny_sft_lora.yaml --model.init_from BASE

The data is raw text (``data.TextDataModule``, what ``data:`` configures when it names no class) or chat /
instruction samples for supervised fine-tuning (``data: {class_path: recipes.decoder.sft_data.SFTDataModule,
init_args: {...}}``).

Every check of the configuration runs before any worker process starts: strategy and callback options (shown alone,
not inside jsonargparse's report), the resume checkpoint (a recipe checkpoint whose model matches the configured
one), the tokenizer against the model's vocabulary, the context length against the model's positions, and the data
(read, checked and tokenised into the cache by ``prepare``, or here when Lightning's own launcher starts the ranks;
ranks started by torchrun / SLURM stop at once if the cache is not prepared).
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Any, Optional

if __package__ in (None, ""):
    import script_path  # noqa: F401  (run as a file: makes `recipes` importable, see script_path.py)

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningCLI
from torch import Tensor

from lightning_npu import GracefulPreemption, NonFiniteLossGuard, TokenThroughputMonitor  # importing the plugin registers accelerator="npu" and npu_*
from lightning_npu.facts import parallel_rules
from lightning_npu.facts.options import FSDPOptions
from lightning_npu.facts.parallel_rules import BatchShapes
from recipes.decoder.data import NotPreparedError, TextDataModule, check_vocab_fits
from recipes import families
from recipes.decoder.module import DecoderLM
from recipes.decoder.sft_data import SFTDataModule

RECIPE_DIR = Path(__file__).resolve().parent
#: The data of a run that configures none (no data: section, no --data... argument): text, the embedded corpus.
DEFAULT_DATA = f"--data={TextDataModule.__module__}.{TextDataModule.__name__}"


def _script(name: str) -> str:
    """The recipe's script ``name`` as a user would type it here: relative to the working directory if inside it."""
    script = RECIPE_DIR / name
    return str(script.relative_to(Path.cwd()) if script.is_relative_to(Path.cwd()) else script)


class RunSummary(Callback):
    """Prints the first and last training loss, where the checkpoint went, and how to generate from it."""

    def __init__(self) -> None:
        # Device tensors, read once at the end: a float() per batch would stall the NPU's queue every step.
        self.first_loss: Optional[Tensor] = None
        self.last_loss: Optional[Tensor] = None

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        loss = outputs["loss"].detach() * trainer.accumulate_grad_batches  # Lightning's is / accumulate_grad_batches
        self.first_loss = loss if self.first_loss is None else self.first_loss
        self.last_loss = loss

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.first_loss is None:
            return
        # Each rank's loss is its replica's, or under context parallelism its share: the step's is their mean (a
        # collective, so every rank takes part).
        first, last = trainer.strategy.reduce(torch.stack([self.first_loss, self.last_loss]).float(),
                                              reduce_op="mean").tolist()
        if trainer.global_rank != 0:
            return
        print(f"train loss: first {first:.4f} -> last {last:.4f}")
        checkpoint = trainer.checkpoint_callback
        path = getattr(checkpoint, "last_model_path", "") or getattr(checkpoint, "best_model_path", "")
        if path:
            print(f"checkpoint: {path}")
            command = ["python", _script("generate.py"), path, "--prompt", "The", "--max-new-tokens", "40"]
            print("generate: " + shlex.join(command))
            if getattr(pl_module, "lora", None) is not None:
                convert = _script("convert.py")
                print("export the adapter: " + shlex.join(["python", convert, "to-peft", path, "lora-adapter"]))


class RecipeCLI(LightningCLI):
    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.link_arguments("data.init_args.tokenizer", "model.tokenizer_path")

    def parse_arguments(self, parser: Any, args: Any) -> None:
        super().parse_arguments(parser, args)
        # Before LightningCLI reads ckpt_path (torch.load of any file, whose hyper-parameters then silently replace
        # the configured model's) and before anything is built.
        subcommand = self.config.get("subcommand")
        if subcommand:
            config = self.config[subcommand]
            model = config.get("model")
            try:
                family = families.get(model.family)
            except ValueError as err:
                sys.exit(f"error: {err}")
            ckpt_path = config.get("ckpt_path")
            if ckpt_path not in (None, "last", "hpc", "best", "registry"):
                configured = family.config_class.from_preset(model.preset, **(model.config or {}))
                check_resume_checkpoint(str(ckpt_path), configured)

    def instantiate_classes(self) -> None:
        check_class_options(self.config.get(self.subcommand, self.config) if self.subcommand else self.config)
        super().instantiate_classes()

    def before_fit(self) -> None:
        check_run(self.model, self.datamodule, self.trainer)


def check_class_options(config: Any) -> None:
    """Build the data module, the strategy and the callbacks once from their ``class_path`` / ``init_args``, so an
    error of theirs (a bad value, a missing dataset) is the whole message. jsonargparse would report it as one line
    of its "Union subtypes" report."""
    from jsonargparse import Namespace
    from jsonargparse.typing import import_object

    trainer = config.get("trainer") or {}
    callbacks = trainer.get("callbacks") or []
    entries = [("data", config.get("data")), ("trainer.strategy", trainer.get("strategy"))]
    entries += [(f"trainer.callbacks[{i}]", c) for i, c in enumerate(callbacks if isinstance(callbacks, list) else [callbacks])]
    for where, value in entries:
        if not isinstance(value, Namespace) or not isinstance(value.get("class_path"), str):
            continue
        init_args = dict(value.get("init_args") or {})
        if any(isinstance(v, Namespace) for v in init_args.values()):
            continue  # nested classes: left to jsonargparse
        try:
            cls = import_object(value.class_path)
            cls(**init_args)
        except (ValueError, TypeError, OSError) as err:
            sys.exit(f"error: {where} ({value.class_path.rsplit('.', 1)[-1]}): {err}")
        except ImportError:
            continue  # jsonargparse names an unknown class_path itself


def check_run(model: DecoderLM, data: TextDataModule, trainer: Optional[Trainer] = None) -> None:
    """Configuration errors that would otherwise surface inside the workers, after start-up (the resume
    checkpoint is checked earlier, in RecipeCLI.parse_arguments)."""
    init_from = model.hparams.init_from
    if init_from and not Path(init_from).exists():
        raise FileNotFoundError(
            f"model.init_from={init_from!r} does not exist; give a local Hugging Face directory (config.json +"
            " safetensors) or a recipe checkpoint, or remove init_from to train from scratch"
        )
    check_vocab_fits(data.vocab_size, model.config.vocab_size)
    if data.seq_len > model.config.max_seq_len:
        raise ValueError(
            f"data.seq_len={data.seq_len} exceeds the model's max_seq_len={model.config.max_seq_len}:"
            f" rotary positions beyond it were never trained. Lower data.seq_len or set"
            f" model.config.max_seq_len >= {data.seq_len}"
        )
    if trainer is not None:
        check_parallel_layout(model, data, trainer)
        prepare_before_launch(data, trainer)


def check_parallel_layout(model: DecoderLM, data: TextDataModule, trainer: Trainer) -> None:
    """npu_fsdp's tensor, context and pipeline parallelism against the model and the data, before workers start:
    the rules the runtime and the planner read too (``lightning_npu.facts.parallel_rules``), then the model
    config's own limits under context parallelism (its ``context_parallel_refusal()``, if it has one)."""
    options = getattr(trainer.strategy, "options", None)
    if not isinstance(options, FSDPOptions):
        return
    packed_by = f"data ({type(data).__name__})" if isinstance(data, SFTDataModule) else None
    parallel_rules.check(options, model.parallel_shapes(),
                         BatchShapes(seq_len=data.seq_len, batch_size=data.batch_size, packed_by=packed_by))
    refusal = getattr(model.config, "context_parallel_refusal", None)  # a model config's own limits
    reason = refusal() if refusal is not None and options.context_parallel_size > 1 else None
    if reason is not None:
        raise ValueError(f"context_parallel_size={options.context_parallel_size}: {reason}")


def check_resume_checkpoint(ckpt_path: str, config: Any) -> None:
    """``ckpt_path`` must be a recipe checkpoint of the configured model's shape (reads only its metadata)."""
    from recipes.decoder.checkpoint_layout import config_from_hparams, fused_gate_up_names, read_recipe_metadata, some_names

    if not Path(ckpt_path).exists():
        raise FileNotFoundError(
            f"ckpt_path={ckpt_path!r} does not exist; give the path of a checkpoint file or sharded checkpoint"
            " directory written by an earlier run (its location is printed at the end of that run)"
        )
    try:
        stored = config_from_hparams(read_recipe_metadata(ckpt_path).get("hyper_parameters"), source=ckpt_path)
    except Exception as err:  # torch.load fails on other files in many ways (KeyError, UnpicklingError, ...)
        raise ValueError(
            f"ckpt_path={ckpt_path!r} is not a checkpoint of this recipe ({type(err).__name__}: {err}); give a"
            " last.ckpt / epoch=...ckpt file or directory written by recipes/train.py"
        ) from None
    fused = fused_gate_up_names(ckpt_path)
    if fused:
        raise ValueError(
            f"ckpt_path={ckpt_path!r} was written when the MLP fused its gate and up projections in one layer"
            f" ({some_names(fused, 2)}); its optimizer state follows that layout, so it cannot resume here. Start"
            f" from its weights instead: --model.init_from {ckpt_path} without ckpt_path (the weights load as they"
            " were; the optimizer state and LR schedule start afresh)"
        )
    if type(stored) is not type(config):
        raise ValueError(
            f"ckpt_path={ckpt_path!r} holds a model of family {families.name_of_config(stored)!r}, but the config's"
            f" model.family is {families.name_of_config(config)!r}; resume it with the family it was trained as"
        )
    differences = [(name, value, getattr(config, name)) for name, value in stored.to_dict().items()
                   if getattr(config, name) != value]
    if differences:
        shown = ", ".join(f"{name}: checkpoint {old!r} vs configured {new!r}" for name, old, new in differences)
        raise ValueError(
            f"ckpt_path={ckpt_path!r} holds a different model ({shown}); resuming restores the checkpoint's weights"
            " and optimizer, so the shapes must match. Configure the model as it was (model.preset / model.config),"
            " or start from its weights with model.init_from instead of ckpt_path"
        )


def prepare_before_launch(data: TextDataModule, trainer: Trainer) -> None:
    """Read, check and tokenise the data here, before the ranks exist, so no rank waits for it under the
    process-group timeout. Ranks started by an outside launcher (torchrun, SLURM, another node) are already
    running: they stop at once when the cache is missing, naming the command that prepares it."""
    if data.is_prepared():
        return
    environment = getattr(trainer.strategy, "cluster_environment", None)
    launched_outside = environment is not None and environment.creates_processes_externally
    if trainer.world_size > 1 and (launched_outside or trainer.num_nodes > 1):
        raise NotPreparedError(data.not_prepared_message(trainer.world_size))
    data.prepare()


def prepare(args: list[str]) -> dict[str, Any]:
    """``train.py prepare --config ...``: the data section of a training config, tokenised into its cache."""
    from jsonargparse import ActionConfigFile, ArgumentParser

    parser = ArgumentParser(prog="train.py prepare", description="Check and tokenise the data of a training config"
                            " into its cache (data.cache_dir), so that multi-rank training starts at once.")
    parser.add_argument("--config", action=ActionConfigFile, help="the training config (only its data section is used)")
    parser.add_subclass_arguments(TextDataModule, "data", required=True)
    for other in ("model", "trainer", "optimizer", "lr_scheduler"):  # parts of the training config, not used here
        parser.add_argument(f"--{other}", type=Optional[Any], default=None)
    parser.add_argument("--seed_everything", type=Optional[Any], default=None)
    parser.add_argument("--ckpt_path", type=Optional[str], default=None)
    config = parser.parse_args(args)
    check_class_options(config)
    data = parser.instantiate(config).data
    if data.is_prepared():
        print(f"already prepared: {data.cache_path}")
    return data.prepare()


def configures_data(argv: list[str]) -> bool:
    """Whether the command line, or a ``--config`` file it names, configures the data (a ``data:`` section)."""
    import yaml

    for i, arg in enumerate(argv):
        if arg == "--data" or arg.startswith(("--data.", "--data=")):
            return True
        config = argv[i + 1] if arg == "--config" and i + 1 < len(argv) else arg.partition("=")[2] if arg.startswith(
            "--config=") else None
        if config is not None and Path(config).is_file():
            document = yaml.safe_load(Path(config).read_text())
            if isinstance(document, dict) and document.get("data") is not None:
                return True
    return False


def main(args: Optional[list[str]] = None, model_class: type[DecoderLM] = DecoderLM) -> Any:
    """The command line of ``model_class``, ``DecoderLM`` or a subclass of it (an objective: ``recipes/posttrain``)."""
    argv = list(sys.argv[1:] if args is None else args)
    # The data class is a choice (text or SFT): LightningCLI then requires a data section. A run that gives none gets
    # the text data here; a default class in the parser would instead hand its defaults (path, val_fraction, ...) to
    # whichever class a config names.
    if argv[:1] and not argv[0].startswith("-") and not configures_data(argv[1:]):
        argv.append(DEFAULT_DATA)
        if args is None:
            sys.argv.append(DEFAULT_DATA)  # what LightningCLI reads, and what Lightning's launcher re-runs per rank
    if argv[:1] == ["prepare"]:
        return prepare(argv[1:])
    return RecipeCLI(
        model_class,
        TextDataModule,
        subclass_mode_data=True,  # SFTDataModule too; a data: section without class_path is a TextDataModule
        trainer_defaults={"callbacks": [TokenThroughputMonitor(), RunSummary(), ModelCheckpoint(save_last=True),
                                       GracefulPreemption(save_on_preemption=True), NonFiniteLossGuard()]},
        save_config_kwargs={"overwrite": False},
        args=None if args is None else argv,
    )


if __name__ == "__main__":
    main()
