"""``keel lint`` preview rules that stay quiet where one file shows no fault (issue 55, second
pass over the measured false findings): each form as users write it, and the fault still found."""

from __future__ import annotations

import textwrap

from torchkeel.lint import lint_source, select_rules


def found(text: str, code: str, path: str = "train.py") -> list[int]:
    return [f.line for f in lint_source(textwrap.dedent(text), path, select_rules([code])) if f.code == code]


# --- TK111: gradients turned off by the caller, or by set_grad_enabled(False) ---------------------

EVALUATOR = """
    import torch
    class Evaluator:
        def __init__(self, model, loader):
            self.model = model
            self.loader = loader

        def run_all_evals(self):
            scores = {}
            with torch.no_grad():
                self.evaluate_clm(scores)
            return scores

        def evaluate_clm(self, scores):
            self.model.eval()
            total = 0.0
            for x, y in self.loader:
                total += self.model(x).sub(y).abs().sum().item()
            scores["clm"] = total
    """


def test_tk111_quiet_when_every_caller_runs_it_under_no_grad():
    assert found(EVALUATOR, "TK111") == []


def test_tk111_quiet_under_set_grad_enabled_false():
    text = """
        import torch
        def test(model, data):
            model.eval()
            loss = 0.0
            with torch.set_grad_enabled(False):
                for batch in iter(data.dev_iter):
                    p1, p2 = model(batch)
                    loss += (p1.sum() + p2.sum()).item()
            return loss
        """
    assert found(text, "TK111") == []


def test_tk111_still_fires_when_a_caller_keeps_gradients_on():
    enabled = EVALUATOR.replace("torch.no_grad()", "torch.set_grad_enabled(True)")
    assert found(enabled, "TK111") == [18]
    also_bare = EVALUATOR.rstrip(" ") + "    def report(evaluator):\n        evaluator.evaluate_clm({})\n"
    assert found(also_bare, "TK111") == [18]  # one caller with gradients on is enough


# --- TK133 / TK110: a model with no dropout and no batch norm behaves the same in both modes -------

BEGINNER = """
    import torch
    from torch import nn, optim

    class neuralNetwork(nn.Module):
        def __init__(self, in_dim, n_hidden, out_dim):
            super().__init__()
            self.layer1 = nn.Sequential(nn.Linear(in_dim, n_hidden), nn.ReLU(True))
            self.layer2 = nn.Linear(n_hidden, out_dim)

        def forward(self, x):
            return self.layer2(self.layer1(x))

    model = neuralNetwork(28 * 28, 300, 10)
    if torch.cuda.is_available():
        model = model.cuda()
    criterion = nn.CrossEntropyLoss()
    optimizer = optim.SGD(model.parameters(), lr=1e-2)
    for epoch in range(10):
        for img, label in train_loader:
            loss = criterion(model(img.view(img.size(0), -1)), label)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        model.eval()
        eval_loss = 0.0
        for img, label in test_loader:
            with torch.no_grad():
                eval_loss += criterion(model(img.view(img.size(0), -1)), label).item()
    """


def test_tk133_quiet_on_a_model_without_dropout_or_batch_norm():
    assert found(BEGINNER, "TK133") == []  # model = model.cuda() is the same module, read through


def test_tk133_still_fires_when_the_model_has_dropout():
    with_dropout = BEGINNER.replace("nn.ReLU(True))", "nn.ReLU(True), nn.Dropout(0.5))")
    assert found(with_dropout, "TK133") == [25]


ATTENTION = """
    import torch
    import torch.nn as nn
    from torch.distributions import Normal

    class LocationNetwork(nn.Module):
        def __init__(self, input_size, output_size, std):
            super().__init__()
            self.std = std
            self.fc = nn.Linear(input_size, output_size)

        def forward(self, h_t):
            mu = torch.tanh(self.fc(h_t.detach()))
            l_t = Normal(mu, self.std).rsample()
            return mu, torch.clamp(l_t, -1, 1)

    def train(loader, valid_loader):
        model = LocationNetwork(256, 2, 0.05)
        optimizer = torch.optim.Adam(model.parameters())
        for x, y in loader:
            mu, l_t = model(x)
            loss = (l_t - y).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        with torch.no_grad():
            for x, y in valid_loader:
                mu, l_t = model(x)
    """


def test_tk110_quiet_when_the_model_draws_from_a_torch_distribution_but_holds_no_mode_layer():
    assert found(ATTENTION, "TK110") == []  # Normal(mu, std) is a value, not a layer


def test_tk110_still_fires_when_the_model_has_batch_norm():
    with_norm = ATTENTION.replace(
        "self.fc = nn.Linear(input_size, output_size)",
        "self.fc = nn.Sequential(nn.Linear(input_size, output_size), nn.BatchNorm1d(output_size))",
    )
    assert found(with_norm, "TK110") == [28]


# --- TK116: a new file per save, named by concatenation or by a caller in another file ------------


def test_tk116_quiet_on_a_count_concatenated_into_the_path():
    text = """
        import torch
        def train(net, optimizer, loader, results_dir):
            train_step = 0
            while train_step < 25000:
                for images, gt in loader:
                    loss = net(images).sub(gt).pow(2).mean()
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
                    train_step += 1
                    if train_step % 1000 == 0:
                        save_param_path = results_dir + "/CRAFT_clr_amp_" + repr(train_step) + ".pth"
                        torch.save({"iter": train_step, "craft": net.state_dict()}, save_param_path)
        """
    assert found(text, "TK116") == []
    fixed = text.replace('"/CRAFT_clr_amp_" + repr(train_step) + ".pth"', '"/CRAFT_clr_amp_" + repr(0) + ".pth"')
    assert found(fixed, "TK116") == [14]


UTILS = """
    import torch

    def save_checkpoint(model, optimizer, learning_rate, iteration, checkpoint_path):
        state_dict = model.state_dict()
        torch.save({"model": state_dict, "iteration": iteration, "optimizer": optimizer.state_dict(),
                    "learning_rate": learning_rate}, checkpoint_path)
    """

TRAIN = """
    import os
    import utils

    def train_and_evaluate(hps, net_g, optim_g, loader):
        global_step = 0
        for epoch in range(1, hps.train.epochs + 1):
            for batch in loader:
                loss = net_g(batch).mean()
                optim_g.zero_grad()
                loss.backward()
                optim_g.step()
                global_step += 1
                if global_step % hps.train.eval_interval == 0:
                    utils.save_checkpoint(net_g, optim_g, hps.train.learning_rate, epoch,
                                          os.path.join(hps.model_dir, "G_{}.pth".format(global_step)))
    """


def _project(tmp_path, train: str) -> list[int]:
    (tmp_path / "utils.py").write_text(textwrap.dedent(UTILS))
    (tmp_path / "train.py").write_text(textwrap.dedent(train))
    text = (tmp_path / "utils.py").read_text()
    return [f.line for f in lint_source(text, str(tmp_path / "utils.py"), select_rules(["TK116"]))]


def test_tk116_quiet_on_a_helper_whose_caller_in_another_file_names_a_file_per_step(tmp_path):
    assert _project(tmp_path, TRAIN) == []


def test_tk116_quiet_on_a_final_save_to_a_fixed_name_after_the_loop(tmp_path):
    final = (
        TRAIN.rstrip(" ")
        + '    utils.save_checkpoint(net_g, optim_g, 0.0, 0, os.path.join(hps.model_dir, "last.pth"))\n'
    )
    assert _project(tmp_path, final) == []  # runs once, after training: nothing rewritten while it runs


def test_tk116_still_fires_when_another_file_rewrites_one_path_in_the_loop(tmp_path):
    latest = TRAIN.replace('"G_{}.pth".format(global_step)', '"G_latest.pth"')
    assert _project(tmp_path, latest) == [6]
    assert _project(tmp_path, "import utils\n") == [6]  # no caller seen: it may loop


# --- TK105: loaders built at import, iterated only in a guarded main() ----------------------------

GUARDED = """
    import torch
    from torch.utils.data import DataLoader
    from pokemon import Pokemon

    train_db = Pokemon("pokemon", 224, mode="train")
    val_db = Pokemon("pokemon", 224, mode="val")
    train_loader = DataLoader(train_db, batch_size=32, shuffle=True, num_workers=4)
    val_loader = DataLoader(val_db, batch_size=32, num_workers=2)

    def main():
        model = torch.nn.Linear(224, 5)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        for epoch in range(10):
            for step, (x, y) in enumerate(train_loader):
                loss = torch.nn.functional.cross_entropy(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()

    if __name__ == "__main__":
        main()
    """


def test_tk105_quiet_when_the_loaders_are_iterated_only_under_the_main_guard():
    assert found(GUARDED, "TK105") == []


def test_tk105_still_fires_when_import_runs_the_loop():
    unguarded = GUARDED.replace('if __name__ == "__main__":\n        main()', "main()")
    assert found(unguarded, "TK105") == [8]
    peek = GUARDED.replace("    def main():", "    x, y = next(iter(train_loader))\n\n    def main():")
    assert found(peek, "TK105") == [8]


# --- TK101: numbers, a sum differentiated on purpose, one loss built from its terms ---------------

EPOCH = """
    import torch
    def train_epoch(model, optimizer, loader):
        model.train()
        epoch_loss = 0
        for x, y in loader:
            optimizer.zero_grad()
            loss = model.loss(model(x), y)
            loss.backward()
            optimizer.step()
            loss_ = loss.detach().item()
            epoch_loss += loss_
        return epoch_loss / len(loader)
    """


def test_tk101_quiet_on_a_float_read_with_item():
    assert found(EPOCH, "TK101") == []


def test_tk101_still_fires_on_the_tensor_itself():
    assert found(EPOCH.replace("epoch_loss += loss_", "epoch_loss += loss"), "TK101") == [12]


def test_tk101_quiet_on_a_sum_differentiated_after_the_loop_and_on_a_loss_built_from_terms():
    text = """
        import torch
        import torch.nn.functional as F
        from torch import autograd

        def update(network, minibatches):
            total_loss = 0
            for x, y in minibatches:
                env_loss = F.cross_entropy(network(x), y)
                total_loss += env_loss
            mean_loss = total_loss / len(minibatches)
            return autograd.grad(mean_loss, network.parameters(), create_graph=True)

        def ewc_loss(layers, loss_for_layer):
            l = 0.0
            for name, layer in layers:
                nl = loss_for_layer(name, layer)
                l += nl
            return 0.5 * l
        """
    assert found(text, "TK101") == []


def test_tk101_quiet_on_python_floats_in_a_file_without_torch():
    text = """
        w = 1.0
        def loss(x, y):
            return (x * w - y) * (x * w - y)
        for epoch in range(10):
            l_sum = 0
            for x_val, y_val in zip([1.0, 2.0], [2.0, 4.0]):
                l = loss(x_val, y_val)
                l_sum += l
        """
    assert found(text, "TK101") == []


# --- TK102: values already on the host ---------------------------------------------------------


def test_tk102_quiet_on_host_values_read_in_forward():
    text = """
        import numpy as np
        import torch
        from torch import nn

        class Flatten(nn.Module):
            def forward(self, x):
                shape = torch.prod(torch.tensor(x.shape[1:])).item()
                return x.view(-1, shape)

        class Decoder(nn.Module):
            def forward(self, inputs, max_length, batch_size):
                lengths = np.array([max_length] * batch_size)
                outputs = self.rnn(inputs)
                return outputs, lengths.tolist()

        class RegionProposalNetwork(nn.Module):
            def forward(self, x, anchor, img_size):
                rpn_locs, rpn_scores = self.loc(x), self.score(x)
                return self.proposal_layer(rpn_locs[0].cpu().data.numpy(), rpn_scores[0].cpu().data.numpy(), anchor, img_size)
        """
    assert found(text, "TK102") == []


def test_tk102_still_fires_on_a_model_tensor_read_in_forward():
    text = """
        import torch
        from torch import nn

        class Attention(nn.Module):
            def forward(self, x, attn_mask):
                if attn_mask is not None and attn_mask.any().item():
                    x = x.masked_fill(attn_mask, 0.0)
                shape = torch.prod(torch.tensor(x.shape[1:], device=x.device)).item()
                return x.view(-1, shape)
        """
    assert found(text, "TK102") == [7, 9]


# --- TK122: hooks on a model's inner layers run under model.forward() too ------------------------

FROMP = """
    import torch
    from torch import nn

    def _update_input(module, inputs, outputs):
        module.data_input = inputs[0]

    class Fromp(torch.optim.Optimizer):
        def __init__(self, model, lr=1e-3):
            super().__init__(model.parameters(), dict(lr=lr))
            self.model = model
            self.train_modules = [m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
            for module in self.train_modules:
                module.register_forward_hook(_update_input)

        def init_context(self, memorable_points):
            logits = self.model.forward(memorable_points)
            return torch.softmax(logits, dim=-1)
    """


def test_tk122_quiet_when_hooks_sit_on_the_inner_layers():
    assert found(FROMP, "TK122") == []
    walk = FROMP.replace(
        "for module in self.train_modules:\n                module.register",
        "for module in model.modules():\n                if isinstance(module, nn.Linear):\n                    module.register",
    )
    assert found(walk, "TK122") == []


def test_tk122_still_fires_when_the_hook_is_on_the_model_itself():
    on_model = FROMP.replace(
        "for module in self.train_modules:\n                module.register_forward_hook(_update_input)",
        "model.register_forward_hook(_update_input)",
    )
    assert found(on_model, "TK122") == [16]
    every = FROMP.replace("for module in self.train_modules:", "for module in model.modules():")
    assert found(every, "TK122") == [17]  # modules() yields the model itself first


def test_tk111_quiet_when_the_evaluation_takes_gradients_on_purpose():
    text = """
        import torch
        import torch.nn.functional as F

        def validate_pgd(val_loader, model, eps, step, n_iter):
            model.eval()
            correct = 0
            for input, target in val_loader:
                delta = torch.zeros_like(input, requires_grad=True)
                for _ in range(n_iter):
                    loss = F.cross_entropy(model(input + delta), target)
                    grad = torch.autograd.grad(loss, delta)[0]
                    delta = (delta + step * grad.sign()).clamp(-eps, eps).detach().requires_grad_()
                with torch.no_grad():
                    correct += (model(input + delta).argmax(1) == target).sum().item()
            return correct
        """
    assert found(text, "TK111") == []  # the gradient with respect to the input is the attack
    clean = text.replace("grad = torch.autograd.grad(loss, delta)[0]", "grad = torch.randn_like(delta)")
    assert found(clean, "TK111") == [11]


def test_tk116_quiet_on_a_path_made_per_epoch_by_a_helper_and_opened_through_a_path_manager():
    text = """
        import os
        import torch
        from iopath.common.file_io import g_pathmgr as pathmgr

        def get_checkpoint(out_dir, epoch):
            return os.path.join(out_dir, "model_epoch_{:04d}.pyth".format(epoch))

        def save_checkpoint(model, optimizer, out_dir, epoch):
            checkpoint = {"epoch": epoch, "model_state": model.state_dict(), "optimizer_state": optimizer.state_dict()}
            checkpoint_file = get_checkpoint(out_dir, epoch + 1)
            with pathmgr.open(checkpoint_file, "wb") as f:
                torch.save(checkpoint, f)
            return checkpoint_file
        """
    assert found(text, "TK116") == []
    latest = text.replace(
        "checkpoint_file = get_checkpoint(out_dir, epoch + 1)", 'checkpoint_file = os.path.join(out_dir, "last.pyth")'
    )
    assert found(latest, "TK116") == [13]


def test_tk116_quiet_on_a_cache_written_only_when_missing_fires_on_an_existing_file_rewritten():
    text = """
        import os
        import torch

        class TextAudioLoader(torch.utils.data.Dataset):
            def __getitem__(self, index):
                audio, spec_filename = self.load_audio(index)
                if os.path.exists(spec_filename):
                    spec = torch.load(spec_filename)
                else:
                    spec = self.spectrogram(audio)
                    torch.save(spec, spec_filename)
                return spec, audio
        """
    assert found(text, "TK116") == []
    rewritten = text.replace(
        "spec = torch.load(spec_filename)\n",
        "spec = torch.load(spec_filename) * 0.5\n                    torch.save(spec, spec_filename)\n",
    )
    assert found(rewritten, "TK116") == [10]


LIBRARY_TRAIN = """
    import os
    from model.utils.net_utils import save_checkpoint
    for epoch in range(1, args.max_epochs + 1):
        train_one_epoch(fasterRCNN, optimizer, dataloader)
        save_name = os.path.join(output_dir, "faster_rcnn_{}_{}_{}.pth".format(args.session, epoch, step))
        save_checkpoint({"epoch": epoch + 1, "model": fasterRCNN.state_dict()}, save_name)
    """


def _library(root, train: str) -> list[int]:
    utils = root / "lib" / "model" / "utils"
    utils.mkdir(parents=True)
    path = utils / "net_utils.py"
    path.write_text("import torch\n\ndef save_checkpoint(state, filename):\n    torch.save(state, filename)\n")
    (root / "trainval_net.py").write_text(textwrap.dedent(train))
    return [f.line for f in lint_source(path.read_text(), str(path), select_rules(["TK116"]))]


def test_tk116_quiet_on_a_library_helper_named_per_epoch_by_the_root_train_script(tmp_path):
    assert _library(tmp_path / "per_epoch", LIBRARY_TRAIN) == []
    assert _library(
        tmp_path / "last",
        LIBRARY_TRAIN.replace('"faster_rcnn_{}_{}_{}.pth".format(args.session, epoch, step)', '"faster_rcnn_last.pth"'),
    ) == [4]
