"""torchrun --nproc_per_node=P launch/train.py [tensor_parallel_size=T data_parallel_size=P/T max_steps=N ...]

`python -m train` under torchrun with Hydra, as the other launchers run: the settings are TrainSettings' fields
(train/settings.py) as Hydra keys, checked on every rank before any collective (one line, exit 2); each torchrun
process is one rank of the tp x dp world; rank 0 prepares the corpus while the others wait. The model, its curve and
train_log.jsonl go to output_dir (default: Hydra's run directory, outputs/train).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script by torchrun: the repository first (not launch/train.py as `train`)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from launch.settings import launch, run_dir, script_main
from tp.dist import ConfigError
from train.settings import TrainSettings, from_mapping

ConfigStore.instance().store(name="train_defaults",
                             node={f.name: f.default for f in dataclasses.fields(TrainSettings)})


def parse_settings(cfg: DictConfig, world_size: int, local_world_size: int) -> TrainSettings:
    """TrainSettings from Hydra's keys, checked (ConfigError, the same on every rank)."""
    values = OmegaConf.to_container(cfg, resolve=True)
    values["output_dir"] = values.get("output_dir") or str(run_dir())
    try:
        s = from_mapping(values)
        s.validate(world_size)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return s


def work(s: TrainSettings, directory, ctx) -> int:
    from train.run import train_world

    try:
        train_world(s, ctx, prepared=False)
    except ValueError as exc:  # rank 0's preparation, or a checkpoint the ranks cannot resume from
        raise ConfigError(str(exc)) from None
    return 0


def run(cfg: DictConfig) -> int:
    """launch.settings.launch: settings on every rank (exit 2), the group joined, train, the group left."""
    return launch(cfg, parse_settings, work)


if __name__ == "__main__":
    script_main(run, "train")
