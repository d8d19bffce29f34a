"""Optimizers as people name them and parameter groups as the references build them: any
``torch.optim`` class by name, weight decay on matrices only (nanoGPT) or without biases and norm
weights (transformers' Trainer), groups by name pattern, reported at the start, resumed exactly."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch
from torch import nn

import torchkeel as tk
from torchkeel.config import load_config
from torchkeel.train.hooks import TrainerHooks
from torchkeel.train.optim import build_optimizer, param_groups


def optim_config(**optim):
    """The optim section as a user writes it, through the config loader."""
    return load_config(None, base={"model": {"target": "x:y"}, "optim": optim}).optim


class TinyTransformer(nn.Module):
    """Names as real models have them: a LayerNorm called ``ln_1``, an RMSNorm called ``norm``,
    a norm under ``attn_norm``, biases, an embedding, a head."""

    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(11, 8)
        self.ln_1 = nn.LayerNorm(8)
        self.attn = nn.Linear(8, 8)
        self.attn_norm = nn.RMSNorm(8)
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
        self.norm = nn.RMSNorm(8)
        self.lm_head = nn.Linear(8, 11, bias=False)
        self.scale = nn.Parameter(torch.ones(8))  # a parameter of the root itself

    def forward(self, x):
        h = self.ln_1(self.wte(x))
        h = h + self.mlp(self.attn_norm(self.attn(h)))
        return self.lm_head(self.norm(h) * self.scale)


def groups_by_name(groups):
    return {g.name: (set(g.names), g.lr, g.weight_decay) for g in groups}


@pytest.mark.parametrize("name, cls", [("Adadelta", "Adadelta"), ("RMSprop", "RMSprop"), ("nadam", "NAdam")])
def test_any_torch_optimizer_by_its_name_in_any_case(name, cls):
    cfg = optim_config(name=name, lr=1.0, args={"rho": 0.9} if cls == "Adadelta" else {})
    optimizer = build_optimizer(cfg, nn.Linear(4, 2).named_parameters())
    assert type(optimizer).__name__ == cls and optimizer.defaults["lr"] == 1.0
    assert optimizer.defaults.get("foreach") is True  # the multi-tensor update where the class has one


def test_an_unknown_optimizer_name_lists_the_valid_ones():
    with pytest.raises(tk.ConfigError, match=r"optim.name='adamx' .*did you mean 'adamax'.*adadelta, .*sgd") as e:
        build_optimizer(optim_config(name="adamx"), nn.Linear(4, 2).named_parameters())
    assert "\n" not in str(e.value) and "lbfgs" not in str(e.value)


def test_weight_decay_is_not_passed_to_an_optimizer_without_it_unless_asked():
    optimizer = build_optimizer(optim_config(name="Rprop"), nn.Linear(4, 2).named_parameters())
    assert type(optimizer) is torch.optim.Rprop
    with pytest.raises(tk.ConfigError, match=r"torch.optim.Rprop takes no weight decay; set optim.weight_decay"):
        build_optimizer(optim_config(name="Rprop", weight_decay=0.1), nn.Linear(4, 2).named_parameters())
    with pytest.raises(tk.ConfigError, match=r"optim.args.rh0 is not an argument of torch.optim.Adadelta.*'rho'"):
        build_optimizer(optim_config(name="adadelta", args={"rh0": 0.9}), nn.Linear(4, 2).named_parameters())


def test_matrices_decay_as_nanogpt_does():
    model = TinyTransformer()
    groups = param_groups(optim_config(decay_filter="matrices", weight_decay=0.1), model.named_parameters(), model)
    # nanoGPT's configure_optimizers: decay every parameter of 2 or more dimensions, none of the rest.
    decay = {n for n, p in model.named_parameters() if p.dim() >= 2}
    rest = {n for n, p in model.named_parameters() if p.dim() < 2}
    assert groups_by_name(groups) == {"default": (decay, 1e-3, 0.1), "default, no decay": (rest, 1e-3, 0.0)}


def test_the_transformers_filter_is_transformers_trainers_rule():
    model = TinyTransformer()
    groups = param_groups(optim_config(decay_filter="transformers", weight_decay=0.01), model.named_parameters(), model)
    decayed = set(groups_by_name(groups)["default"][0])
    # Biases, LayerNorm weights (by type) and norm weights (by name) get none.
    assert decayed == {"wte.weight", "attn.weight", "mlp.0.weight", "mlp.2.weight", "lm_head.weight", "scale"}
    trainer = pytest.importorskip("transformers.trainer")
    assert decayed == set(trainer.Trainer.get_decay_parameter_names(None, model))


def test_groups_by_pattern_first_match_wins_before_the_decay_filter():
    model = TinyTransformer()
    cfg = optim_config(
        lr=1e-3,
        weight_decay=0.1,
        decay_filter="matrices",
        groups=[{"params": "lm_head.*", "lr": 1e-4}, {"params": ["*.bias", "mlp.*"], "weight_decay": 0.5}],
    )
    got = groups_by_name(param_groups(cfg, model.named_parameters(), model))
    assert got["optim.groups[0]"] == ({"lm_head.weight"}, 1e-4, 0.1)
    assert got["optim.groups[1]"] == ({"mlp.0.weight", "mlp.2.weight"}, 1e-3, 0.5)
    assert got["optim.groups[1], no decay"] == ({"attn.bias", "ln_1.bias", "mlp.0.bias", "mlp.2.bias"}, 1e-3, 0.0)
    assert got["default"][0] == {"wte.weight", "attn.weight"}
    optimizer = build_optimizer(cfg, model.named_parameters(), model)
    assert [(g["lr"], g["weight_decay"]) for g in optimizer.param_groups] == [
        (1e-3, 0.1),
        (1e-3, 0.0),
        (1e-4, 0.1),
        (1e-3, 0.5),
        (1e-3, 0.0),
    ]


def test_a_pattern_that_matches_nothing_is_named():
    model = TinyTransformer()
    cfg = optim_config(groups=[{"params": "head.*", "lr": 1e-4}])
    with pytest.raises(tk.ConfigError, match=r"optim.groups\[0\].params 'head.\*' matches no trainable parameter"):
        param_groups(cfg, model.named_parameters(), model)


def group_factory(params, lr, weight_decay, momentum):
    """An ``optim.target`` factory as users write them."""
    return torch.optim.SGD(params, lr=lr, weight_decay=weight_decay, momentum=momentum)


def test_an_optim_target_gets_the_groups():
    model = TinyTransformer()
    cfg = optim_config(
        target="test_optim_groups:group_factory", args={"momentum": 0.9}, weight_decay=0.1, decay_filter="transformers"
    )
    optimizer = build_optimizer(cfg, model.named_parameters(), model)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    assert optimizer.param_groups[0]["momentum"] == 0.9


def test_groups_of_sharded_parameters_by_name():
    """FSDP2 replaces each parameter with a DTensor under the same name: groups find them."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = TinyTransformer()
        fully_shard(model)
        cfg = optim_config(decay_filter="matrices", weight_decay=0.1, groups=[{"params": "lm_head.*", "lr": 1e-4}])
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        assert all(hasattr(p, "full_tensor") for _, p in named)
        optimizer = build_optimizer(cfg, named, model)
        model(torch.tensor([[1, 2, 3]])).sum().backward()
        before = model.lm_head.weight.full_tensor().clone()
        optimizer.step()
        assert [len(g["params"]) for g in optimizer.param_groups] == [4, 8, 1]
        assert not torch.equal(model.lm_head.weight.full_tensor(), before)
    finally:
        dist.destroy_process_group()


GROUPED = (
    "optim.weight_decay=0.1",
    "optim.decay_filter=matrices",
    "optim.groups=[{params: '3.*', lr: 1e-3, weight_decay: 0.2}]",
)


def rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_the_run_reports_its_groups_once_at_the_start(tiny_config):
    trainer = tk.Trainer(tiny_config(*GROUPED, "train.max_steps=3"), progress=False)
    trainer.fit()
    (report,) = [r for r in rows(trainer.run_dir) if r["kind"] == "param_groups"]
    model = trainer.model  # hand_written_loop's MLP: Linear 0 (32 -> 64), Linear 3 (64 -> 4)
    assert report["step"] == 0 and report["groups"] == [
        {"group": "default", "num_tensors": 1, "num_params": 32 * 64, "lr": 3e-3, "weight_decay": 0.1},
        {"group": "default, no decay", "num_tensors": 1, "num_params": 64, "lr": 3e-3, "weight_decay": 0.0},
        {"group": "optim.groups[0]", "num_tensors": 1, "num_params": 64 * 4, "lr": 1e-3, "weight_decay": 0.2},
        {"group": "optim.groups[0], no decay", "num_tensors": 1, "num_params": 4, "lr": 1e-3, "weight_decay": 0.0},
    ]
    assert model[3].weight is trainer.optimizer.param_groups[2]["params"][0]


def test_a_run_with_groups_resumes_exactly(tiny_config):
    settings = (*GROUPED, "optim.name=RMSprop", "schedule.warmup_steps=5")
    straight = tk.Trainer(tiny_config("name=straight", *settings), progress=False)
    straight.fit()
    calls = [0]

    def stop_at_17(num_samples):
        calls[0] += 1
        if calls[0] == 17:
            os.kill(os.getpid(), signal.SIGTERM)

    stopped = tk.Trainer(tiny_config(*settings), hooks=TrainerHooks(before_forward=stop_at_17), progress=False)
    assert stopped.fit()["status"] == "preempted"
    resumed = tk.Trainer(tiny_config(*settings), resume="auto", progress=False)
    assert resumed.fit()["status"] == "completed"
    want, got = straight.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(want[k], got[k]) for k in want)
    assert [g["lr"] for g in resumed.optimizer.param_groups] == [g["lr"] for g in straight.optimizer.param_groups]
    reported = [[r["groups"] for r in rows(run.run_dir) if r["kind"] == "param_groups"] for run in (straight, resumed)]
    assert reported[0] == reported[1] and len(reported[0]) == 1  # once, not again on resume


def test_a_resume_refuses_new_groups(tiny_config):
    tk.Trainer(tiny_config(*GROUPED, "train.max_steps=3"), progress=False).fit()
    with pytest.raises(tk.ConfigError, match=r"optim.groups differs .* per parameter group"):
        tk.Trainer(
            tiny_config("optim.weight_decay=0.1", "optim.decay_filter=matrices", "train.max_steps=6"),
            resume="auto",
            allow_config_change=True,
            progress=False,
        ).fit()


def test_the_console_names_each_group_once_and_is_quiet_without_groups(tiny_config, capsys):
    tk.Trainer(tiny_config(*GROUPED, "train.max_steps=3"), progress=False).fit()
    lines = [line for line in capsys.readouterr().err.splitlines() if "optimizer group" in line]
    assert len(lines) == 4 and "optimizer group optim.groups[0]: 1 tensors, 256 parameters, lr 0.001" in lines[2]
    tk.Trainer(tiny_config("name=plain", "train.max_steps=3"), progress=False).fit()
    assert "optimizer group" not in capsys.readouterr().err
