"""Invariants on what the script set up: logits and predictions squashed out of the loss's reach,
optimizer coefficients outside [0, 1), a weight decay that outpulls the loss, dropout that drops
most of its input, and evaluation inputs prepared unlike the training ones. Each runs real
training under a probe; each has its healthy twin that stays quiet."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from torchkeel.diagnose.invariants import depth, dropout, inputs, modes, optimizers
from torchkeel.diagnose.probe import Facts, Probe
from torchkeel.diagnose.runner import ScriptOutcome

OK = ScriptOutcome(path="train.py", argv=[])


def probed(train) -> Probe:
    with Probe(anomaly_steps=0) as probe:
        train()
    return probe


def ids(probe: Probe, family) -> list[str]:
    return [f.id for detect in family.DETECTORS for f in detect(probe.facts, OK)]


def fit(model: nn.Module, loss_of, optimizer=None, steps: int = 12, x=None, y=None) -> None:
    optimizer = optimizer or torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(64, 8) if x is None else x
    for _ in range(steps):
        loss = loss_of(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def classifier(last: nn.Module | None = None) -> nn.Module:
    layers = [nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 5)]
    return nn.Sequential(*layers, *([last] if last is not None else []))


def test_logits_squashed_by_a_sigmoid_or_tanh_give_the_loss_a_floor_and_raw_or_relu_logits_do_not():
    y = torch.randint(0, 5, (64,))
    for last, name in ((nn.Sigmoid(), "Sigmoid"), (nn.Tanh(), "Tanh")):
        found = probed(lambda: fit(classifier(last), F.cross_entropy, y=y)).facts.invariants["losses"]["arguments"]
        ev = found["invariant-loss-target-range"]
        assert ev["made_by"] == name and ev["loss"] == "cross_entropy" and ev["loss_floor"] > 0.2 * ev["chance"]
    for last in (None, nn.ReLU()):
        assert probed(lambda: fit(classifier(last), F.cross_entropy, y=y)).facts.invariants["losses"]["arguments"] == {}
    tags = (torch.randn(64, 5) > 0).float()
    bce = F.binary_cross_entropy_with_logits
    found = probed(lambda: fit(classifier(nn.Sigmoid()), bce, y=tags)).facts.invariants["losses"]["arguments"]
    assert found["invariant-loss-target-range"]["made_by"] == "Sigmoid"
    # a sigmoid before the loss that expects probabilities is right
    right = probed(lambda: fit(classifier(nn.Sigmoid()), F.binary_cross_entropy, y=tags))
    assert right.facts.invariants["losses"]["arguments"] == {}


def test_a_relu_output_fit_to_negative_targets_is_out_of_reach_and_to_counts_is_not():
    x = torch.randn(256, 8)
    signed, counts = x[:, :1].clone(), x[:, :1].abs().round()

    def regressor() -> nn.Module:
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1), nn.ReLU())

    ev = probed(lambda: fit(regressor(), F.mse_loss, x=x, y=signed)).facts.invariants["losses"]["arguments"]
    ev = ev["invariant-loss-target-range"]
    assert ev["made_by"] == "Relu" and 0.3 < ev["fraction_outside"] < 0.7
    assert probed(lambda: fit(regressor(), F.mse_loss, x=x, y=counts)).facts.invariants["losses"]["arguments"] == {}


def sgd_run(lr: float = 0.01, **settings) -> Probe:
    model = classifier()
    y = torch.randint(0, 5, (64,))
    opt = torch.optim.SGD(model.parameters(), lr=abs(lr), **settings)
    opt.param_groups[0]["lr"] = lr  # SGD refuses a negative rate when built; a group edited later is not checked
    return probed(lambda: fit(model, F.cross_entropy, opt, y=y))


def test_a_momentum_of_one_and_a_negative_learning_rate_are_outside_the_range_that_converges():
    found = optimizers.unstable_settings(sgd_run(lr=0.01, momentum=1.0).facts, OK)
    assert [f.id for f in found] == ["invariant-optimizer-settings"]
    setting = found[0].evidence["settings"][0]
    assert {k: setting[k] for k in ("optimizer", "index", "group", "key", "value", "valid")} == {
        "optimizer": "SGD",
        "index": 0,
        "group": 0,
        "key": "momentum",
        "value": 1.0,
        "valid": "[0, 1)",
    }
    negative = optimizers.unstable_settings(sgd_run(lr=-0.01, momentum=0.9).facts, OK)
    assert negative[0].evidence["settings"][0]["key"] == "lr"
    assert optimizers.unstable_settings(sgd_run(lr=0.01, momentum=0.9).facts, OK) == []


def test_a_decay_that_outpulls_the_loss_on_every_weight_is_found_and_a_usual_one_is_not():
    def run(decay: float) -> Probe:
        model = classifier()
        y = torch.randint(0, 5, (64,))
        opt = torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=decay)
        return probed(lambda: fit(model, F.cross_entropy, opt, y=y))

    found = optimizers.decay_dominates(run(1.0).facts, OK)
    assert found and found[0].evidence["num_dominated"] == found[0].evidence["num_decayed"] == 2
    assert found[0].evidence["weight_decay"] == [1.0]
    assert optimizers.decay_dominates(run(1e-4).facts, OK) == []


def test_one_starved_tensor_outpulled_by_a_usual_decay_is_not_the_decay_dominating():
    """A layer behind a zero-initialised BatchNorm gets almost no gradient at first: its pull is large
    however small the decay. Only a decay that outpulls even the hardest-pushed tensor is reported."""
    facts = Facts()
    facts.invariants["optimizers"] = {"pulls": {"block.conv.weight": 19.7, "stem.weight": 0.0014}, "decays": [5e-4]}
    assert optimizers.decay_dominates(facts, OK) == []
    facts.invariants["optimizers"]["pulls"]["stem.weight"] = 3.0
    assert optimizers.decay_dominates(facts, OK)[0].evidence["pull_over_grad"]["stem.weight"] == 3.0


class FunctionalDropout(nn.Module):
    def __init__(self, p: float, training_arg: bool) -> None:
        super().__init__()
        self.fc1, self.fc2, self.p, self.training_arg = nn.Linear(8, 32), nn.Linear(32, 5), p, training_arg

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.fc1(x))
        h = F.dropout(h, p=self.p, training=self.training) if self.training_arg else F.dropout(h, self.p)
        return self.fc2(h)


def test_dropout_that_drops_most_of_its_input_is_named_by_its_module_and_line():
    y = torch.randint(0, 5, (64,))
    module_form = probed(lambda: fit(classifier(nn.Dropout(0.9)), F.cross_entropy, y=y))
    found = dropout.drops_most(module_form.facts, OK)
    assert [f.id for f in found] == ["invariant-dropout-drops-most"]
    assert found[0].evidence["p"] == 0.9 and found[0].evidence["module"].endswith("3")
    functional = dropout.drops_most(probed(lambda: fit(FunctionalDropout(0.85, True), F.cross_entropy, y=y)).facts, OK)
    assert functional[0].evidence["call"] == "F.dropout" and functional[0].evidence["file"].endswith(
        "test_invariants_settings.py"
    )
    for quiet in (classifier(nn.Dropout(0.5)), FunctionalDropout(0.3, False)):
        assert dropout.drops_most(probed(lambda: fit(quiet, F.cross_entropy, y=y)).facts, OK) == []


def train_then_evaluate(normalise_eval: bool, noise: float = 0.0) -> Probe:
    raw = torch.randint(0, 256, (600, 16)).float()
    y = (raw[:, :4].mean(1) > 127.5).long()
    mean, std = raw.mean(), raw.std()
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def run() -> None:
        for i in range(0, 500, 50):
            xb = (raw[i : i + 50] - mean) / std
            loss = F.cross_entropy(model(xb + noise * torch.randn_like(xb)), y[i : i + 50])
            opt.zero_grad()
            loss.backward()
            opt.step()
        model.eval()
        with torch.no_grad():
            for i in range(500, 600, 50):
                xb = raw[i : i + 50]
                model((xb - mean) / std if normalise_eval else xb)

    return probed(run)


def test_evaluation_inputs_left_unnormalised_are_unlike_the_training_ones_and_noise_augmentation_is_not():
    found = inputs.eval_inputs_shifted(train_then_evaluate(normalise_eval=False).facts, OK)
    assert [f.id for f in found] == ["invariant-eval-inputs-shifted"]
    ev = found[0].evidence
    assert ev["model"] == "model" and ev["spread_ratio"] > 10 and ev["file"].endswith("test_invariants_settings.py")
    assert inputs.eval_inputs_shifted(train_then_evaluate(normalise_eval=True, noise=0.5).facts, OK) == []
    assert ids(train_then_evaluate(normalise_eval=True), inputs) == []


class Stack(nn.Module):
    """fc1 → (activation?) → (dropout?) → fc2, and a rank-r side path like LoRA's B(A(x))."""

    def __init__(self, activation: bool, dropout: bool = False, lora_rank: int = 0) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 32), nn.Linear(32, 5)
        self.activation, self.dropout = activation, nn.Dropout(0.1) if dropout else nn.Identity()
        self.lora_a = nn.Linear(32, lora_rank, bias=False) if lora_rank else None
        self.lora_b = nn.Linear(lora_rank, 5, bias=False) if lora_rank else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        h = self.dropout(torch.relu(h) if self.activation else h)
        out = self.fc2(h)
        return out + self.lora_b(self.lora_a(h)) if self.lora_a is not None else out


def test_two_linear_layers_with_nothing_but_dropout_between_are_one_linear_map():
    y = torch.randint(0, 5, (64,))
    for extra in ({}, {"dropout": True}):
        found = depth.linear_stack(probed(lambda: fit(Stack(False, **extra), F.cross_entropy, y=y)).facts, OK)
        assert [f.id for f in found] == ["invariant-linear-stack"]
        assert (found[0].evidence["first"], found[0].evidence["second"]) == ("model.fc1", "model.fc2")
    # an activation between, or a bottleneck narrower than both ends (a low-rank factorisation on purpose)
    for quiet in (Stack(True), Stack(True, lora_rank=2)):
        assert depth.linear_stack(probed(lambda: fit(quiet, F.cross_entropy, y=y)).facts, OK) == []


def test_an_optimizer_made_anew_each_step_and_one_made_per_stage_of_many_steps():
    model, y = classifier(), torch.randint(0, 5, (64,))
    x = torch.randn(64, 8)

    def per_step(stages: int, steps_each: int) -> None:
        for _ in range(stages):
            opt = torch.optim.Adam(model.parameters(), lr=1e-3)
            for _ in range(steps_each):
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()

    found = optimizers.optimizer_recreated(probed(lambda: per_step(12, 1)).facts, OK)
    assert [f.id for f in found] == ["invariant-optimizer-recreated"]
    assert found[0].evidence["instances"] == 12 and found[0].evidence["median_steps_each"] == 1
    assert found[0].evidence["file"].endswith("test_invariants_settings.py")
    assert optimizers.optimizer_recreated(probed(lambda: per_step(6, 10)).facts, OK) == []


def test_a_model_left_in_eval_mode_for_its_training_and_a_frozen_teacher_beside_a_student():
    x, y = torch.randn(64, 8), torch.randint(0, 5, (64,))

    def net() -> nn.Module:
        return nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 5))

    def run(student_mode: bool) -> Probe:
        teacher, student = net().eval(), net().train(student_mode)
        opt = torch.optim.Adam(student.parameters(), lr=1e-3)

        def train() -> None:
            for _ in range(8):
                loss = F.cross_entropy(student(x), y) + F.mse_loss(student(x), teacher(x).detach())
                opt.zero_grad()
                loss.backward()
                opt.step()

        return probed(train)

    found = modes.trains_in_eval_mode(run(student_mode=False).facts, OK)
    assert [f.id for f in found] == ["invariant-trains-in-eval-mode"]
    assert found[0].evidence["model"] == "student" and "student.3 (Dropout)" in found[0].evidence["layers"]
    assert modes.trains_in_eval_mode(run(student_mode=True).facts, OK) == []


def test_regression_targets_standardised_for_training_and_raw_in_evaluation():
    x = torch.randn(300, 8)
    y = x[:, :2].sum(1, keepdim=True) * 50 + 300
    mu, sd = y[:250].mean(), y[:250].std()
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    def run(raw_eval: bool) -> Probe:
        def train() -> None:
            for i in range(0, 250, 25):
                loss = F.mse_loss(model(x[i : i + 25]), (y[i : i + 25] - mu) / sd)
                opt.zero_grad()
                loss.backward()
                opt.step()
            with torch.no_grad():
                for i in range(250, 300, 25):
                    target = y[i : i + 25] if raw_eval else (y[i : i + 25] - mu) / sd
                    F.mse_loss(model(x[i : i + 25]), target)

        return probed(train)

    found = inputs.eval_inputs_shifted(run(raw_eval=True).facts, OK)
    assert found[0].evidence["model"] == "the targets of mse_loss" and found[0].evidence["mean_shift"] > 100
    assert inputs.eval_inputs_shifted(run(raw_eval=False).facts, OK) == []


class Rounded(nn.Module):
    def __init__(self, straight_through: bool) -> None:
        super().__init__()
        self.enc, self.head, self.straight_through = nn.Linear(8, 16), nn.Linear(16, 5), straight_through

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        soft = torch.sigmoid(self.enc(x))
        hard = torch.round(soft)
        return self.head(soft + (hard - soft).detach() if self.straight_through else hard)


def test_parameters_behind_a_round_get_zero_gradients_and_a_straight_through_estimator_passes_them():
    y = torch.randint(0, 5, (64,))
    found = optimizers.grads_zero(probed(lambda: fit(Rounded(False), F.cross_entropy, y=y)).facts, OK)
    assert [f.id for f in found] == ["invariant-grads-zero"]
    assert found[0].evidence["parameters"] == ["model.enc.weight"]
    assert optimizers.grads_zero(probed(lambda: fit(Rounded(True), F.cross_entropy, y=y)).facts, OK) == []


class Listed(nn.Module):
    """Hidden layers kept in a plain list (not registered) or in an nn.ModuleList."""

    def __init__(self, registered: bool) -> None:
        super().__init__()
        blocks = [nn.Linear(8, 16), nn.Linear(16, 16)]
        self.blocks = nn.ModuleList(blocks) if registered else blocks
        self.head = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.head(x)


def test_layers_in_a_plain_list_get_gradients_no_optimizer_holds_and_a_module_list_does_not():
    y = torch.randint(0, 5, (64,))
    found = optimizers.grads_not_stepped(probed(lambda: fit(Listed(False), F.cross_entropy, y=y)).facts, OK)
    assert [f.id for f in found] == ["invariant-grads-not-stepped"]
    ev = found[0].evidence
    assert ev["num_parameters"] == 4 and ev["registered"] == 0 and "plain list" in found[0].message
    assert optimizers.grads_not_stepped(probed(lambda: fit(Listed(True), F.cross_entropy, y=y)).facts, OK) == []


def test_a_loss_network_without_an_optimizer_is_not_a_part_left_out():
    """A perceptual loss through a network whose weights still require gradients, beside a trained model."""
    x = torch.randn(64, 8)
    model, judge = nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def train() -> None:
        for _ in range(12):
            loss = F.mse_loss(judge(model(x)), judge(x).detach())
            opt.zero_grad()
            loss.backward()
            opt.step()

    assert optimizers.grads_not_stepped(probed(train).facts, OK) == []


def test_a_schedule_that_grows_the_rate_and_one_that_decays_it():
    def run(gamma: float) -> Probe:
        model, y = classifier(), torch.randint(0, 5, (64,))
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=gamma)

        def train() -> None:
            for _ in range(30):
                fit(model, F.cross_entropy, opt, steps=1, y=y)
                sched.step()

        return probed(train)

    found = optimizers.unstable_settings(run(1.2).facts, OK)
    assert found[0].evidence["scheduler"] == "ExponentialLR" and found[0].evidence["lr_reached"] > 10 * 1e-4
    assert optimizers.unstable_settings(run(0.9).facts, OK) == []


def test_the_reverse_direction_of_a_bidirectional_lstm_read_at_its_last_step_is_not_a_blocked_gradient():
    class BiRNN(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lstm, self.fc = nn.LSTM(4, 8, batch_first=True, bidirectional=True), nn.Linear(16, 5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(self.lstm(x)[0][:, -1, :])

    probe = probed(lambda: fit(BiRNN(), F.cross_entropy, x=torch.randn(64, 6, 4), y=torch.randint(0, 5, (64,))))
    assert optimizers.grads_zero(probe.facts, OK) == []


def test_adam_betas_swapped_break_its_convergence_condition_and_the_usual_ones_do_not():
    def run(betas: tuple[float, float]) -> list:
        model, y = classifier(), torch.randint(0, 5, (64,))
        opt = torch.optim.Adam(model.parameters(), lr=1e-3, betas=betas)
        return optimizers.unstable_settings(probed(lambda: fit(model, F.cross_entropy, opt, y=y)).facts, OK)

    found = run((0.999, 0.9))
    assert found[0].evidence["settings"][0]["key"] == "betas" and "Kingma" in found[0].message
    assert run((0.9, 0.999)) == [] and run((0.9, 0.95)) == []


def test_a_scalar_left_out_of_the_optimizer_is_no_part_of_the_model_that_fails_to_learn():
    class Tempered(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            # the head alone (51 values) is trained: the temperature is 2 % of what the loss reaches, 0.5 % of the model
            self.backbone, self.head = nn.Sequential(nn.Linear(8, 16), nn.ReLU()), nn.Linear(16, 3)
            self.temperature = nn.Parameter(torch.ones(1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.backbone(x)) / self.temperature

    model, y = Tempered(), torch.randint(0, 3, (64,))
    model.backbone.requires_grad_(False)
    opt = torch.optim.Adam(model.head.parameters(), lr=1e-3)
    assert optimizers.grads_not_stepped(probed(lambda: fit(model, F.cross_entropy, opt, y=y)).facts, OK) == []
