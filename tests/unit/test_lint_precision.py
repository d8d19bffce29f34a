"""``keel lint`` reasons about what it can see (issue 55): each rule that fired on fine public code
is quiet on that form, written here the way users write it, and still fires on the fault itself."""

from __future__ import annotations

import textwrap

from torchkeel.lint import lint_source, select_rules


def found(text: str, code: str, path: str = "train.py") -> list[int]:
    return [f.line for f in lint_source(textwrap.dedent(text), path, select_rules([code])) if f.code == code]


# --- TK134: the condition that guards zero_grad, backward and step --------------------------------

DQN = """
    import torch
    import torch.nn.functional as F
    def train(q_network, target_network, rb, args):
        optimizer = torch.optim.SGD(q_network.parameters(), lr=args.learning_rate)
        for global_step in range(args.total_timesteps):
            data = rb.sample(args.batch_size)
            if global_step > args.learning_starts:
                if global_step % args.train_frequency == 0:
                    with torch.no_grad():
                        target = data.rewards + args.gamma * target_network(data.next_obs).max(1)[0]
                    old_val = q_network(data.obs).gather(1, data.actions).squeeze()
                    loss = F.mse_loss(target, old_val)
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
    """


def test_tk134_quiet_when_backward_and_step_share_the_condition():
    assert found(DQN, "TK134") == []  # one backward per step, every train_frequency environment steps


def test_tk134_quiet_when_zero_grad_runs_whenever_backward_does():
    text = """
        import torch
        def train(model, loader, criterion, k):
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            for i, (x, y) in enumerate(loader):
                optimizer.zero_grad()
                loss = criterion(model(x), y)
                loss.backward()
                if (i + 1) % k == 0:
                    optimizer.step()
        """
    assert found(text, "TK134") == []  # cleared before every backward: nothing accumulates


def test_tk134_fires_on_sgd_accumulation_never_divided_quiet_under_adam():
    text = """
        import torch
        def train(model, loader, criterion, k):
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            for i, (x, y) in enumerate(loader):
                loss = criterion(model(x), y)
                loss.backward()
                if (i + 1) % k == 0:
                    optimizer.step()
                    optimizer.zero_grad()
        """
    assert found(text, "TK134") == [7]
    adam = text.replace(
        "torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)", "torch.optim.Adam(model.parameters())"
    )
    assert found(adam, "TK134") == []  # Adam divides the scale out: k summed gradients step like their mean


# --- TK109: the branch a clip is in --------------------------------------------------------------

AMP_OR_NOT = """
    import torch
    def train_step(model, loss, optimizer, scaler, max_norm):
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            if max_norm > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            optimizer.step()
    """


def test_tk109_quiet_on_a_clip_nested_in_the_branch_without_a_scaler():
    assert found(AMP_OR_NOT, "TK109") == []
    amp_unclipped = AMP_OR_NOT.replace("            scaler.unscale_(optimizer)\n", "").replace(
        "            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)\n            scaler.step",
        "            scaler.step",
    )
    assert found(amp_unclipped, "TK109") == []  # only the fp32 branch clips


def test_tk109_quiet_on_a_clip_under_the_opposite_condition_of_a_separate_if():
    text = """
        import torch
        def train_step(model, loss, optimizer, scaler, use_amp):
            if use_amp:
                scaler.scale(loss).backward()
            else:
                loss.backward()
            if not use_amp:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
        """
    assert found(text, "TK109") == []


def test_tk109_fires_on_the_clip_in_the_scaler_branch_without_unscale():
    text = AMP_OR_NOT.replace("            scaler.unscale_(optimizer)\n", "")
    assert found(text, "TK109") == [6]


# --- TK103: a default device set by the script ---------------------------------------------------

GPT = """
    import torch
    class GPT(torch.nn.Module):
        def forward(self, idx):
            pos = torch.arange(0, idx.shape[1], dtype=torch.long)
            return self.wte(idx) + self.wpe(pos)
    """


def test_tk103_quiet_where_the_script_sets_the_default_device():
    script = GPT + "    torch.set_default_device('cuda')\n    model = GPT()\n"
    assert found(script, "TK103") == []


def test_tk103_quiet_under_a_device_block_and_in_a_script_that_sets_it_beside_the_model(tmp_path):
    block = GPT.replace("pos = torch.arange", "with torch.device(idx.device):\n                pos = torch.arange")
    assert found(block + "    model = GPT().cuda()\n", "TK103") == []
    (tmp_path / "model.py").write_text(textwrap.dedent(GPT))
    (tmp_path / "train.py").write_text("import torch\nfrom model import GPT\ntorch.set_default_device('cuda')\n")
    assert found(GPT, "TK103", str(tmp_path / "model.py")) == []


def test_tk103_fires_when_the_model_goes_to_the_gpu_and_the_default_stays():
    assert found(GPT + "    model = GPT().to('cuda')\n", "TK103") == [5]


def test_tk103_quiet_where_nothing_names_a_device():
    assert found(GPT, "TK103", "/nonexistent/tutorial/gpt.py") == []  # the model runs on the CPU


# --- TK104: custom autograd.Function ---------------------------------------------------------------

MASKED_SOFTMAX = """
    import torch
    class XSoftmax(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, mask, dim):
            output = torch.softmax(x.masked_fill(~mask, float("-inf")), dim)
            output.masked_fill_(~mask, 0)
            ctx.save_for_backward(output)
            return output

        @staticmethod
        def backward(ctx, grad):
            (output,) = ctx.saved_tensors
            grad_in = output * grad
            grad_in.sub_(output * grad_in.sum(-1, keepdim=True))
            return grad_in, None, None
    """


def test_tk104_quiet_in_a_custom_autograd_function():
    assert found(MASKED_SOFTMAX, "TK104") == []
    imported = MASKED_SOFTMAX.replace("import torch\n", "import torch\n    from torch.autograd import Function\n")
    assert found(imported.replace("torch.autograd.Function", "Function"), "TK104") == []


def test_tk104_quiet_on_pow_whose_backward_reads_its_input_fires_in_a_module():
    module = """
        import torch
        class Gate(torch.nn.Module):
            def forward(self, x):
                sq = x.pow(2)
                sq += 1
                g = torch.sigmoid(x)
                g.mul_(2)
                return sq, g
        """
    assert found(module, "TK104") == [8]


# --- TK132: the backward in a function called before the clip ------------------------------------


def test_tk132_quiet_when_a_method_called_before_the_clip_runs_the_backward():
    text = """
        import torch
        class Trainer:
            def train(self, loader):
                for inputs in loader:
                    loss = self.training_step(inputs)
                    torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
                    self.optimizer.step()
                    self.optimizer.zero_grad()

            def training_step(self, inputs):
                loss = self.model(**inputs).loss
                loss.backward()
                return loss.detach()
        """
    assert found(text, "TK132") == []


def test_tk132_fires_when_the_clip_comes_before_the_backward():
    text = """
        import torch
        def train(model, loader, optimizer):
            for x, y in loader:
                optimizer.zero_grad()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                loss = torch.nn.functional.cross_entropy(model(x), y)
                loss.backward()
                optimizer.step()
        """
    assert found(text, "TK132") == [6]


# --- TK123: a vocabulary listed from a set --------------------------------------------------------


def test_tk123_fires_on_a_vocabulary_listed_from_a_set():
    text = """
        words = open("corpus.txt").read().split()
        vocab = list(set(words))
        word2idx = {w: i for i, w in enumerate(vocab)}
        chars = sorted(set(words))
        stoi = {c: i for i, c in enumerate(chars)}
        torch.manual_seed(1337)
        """
    assert found(text, "TK123") == [4]
    assert (
        found(text.replace("torch.manual_seed(1337)", "print(len(word2idx))"), "TK123", "/nowhere/vocab.py") == []
    )  # nothing repeats


def test_tk123_fires_on_zip_and_enumerate_outside_a_loop_quiet_once_sorted():
    text = """
        def build(sentences):
            vocab = set()
            for s in sentences:
                vocab.update(s.split())
            words = list(vocab)
            word2idx = dict(zip(words, range(len(words))))
            json.dump(word2idx, open("vocab.json", "w"))
            return word2idx
        """
    assert found(text, "TK123") == [7]
    assert found(text.replace("words = list(vocab)", "words = list(vocab)\n            words.sort()"), "TK123") == []


# --- TK114: a pickle from elsewhere ---------------------------------------------------------------


def test_tk114_quiet_on_the_projects_own_checkpoints_fires_on_weights_from_elsewhere():
    own = """
        import torch
        def fit(model, args):
            torch.save(model.state_dict(), args.save_path)
        def evaluate(model, args):
            model.load_state_dict(torch.load(args.load_model_path, weights_only=False))
        """
    assert found(own, "TK114", "/nowhere/train.py") == []  # it loads what it wrote
    pretrained = """
        import torch
        def get_detector(net, trained_model, device):
            net.load_state_dict(torch.load(trained_model, map_location=device, weights_only=False))
            return net
        """
    assert found(pretrained, "TK114", "/nowhere/detection.py") == [4]  # weights it never wrote
    fetched = """
        import torch
        from huggingface_hub import hf_hub_download
        def fit(model, repo_id):
            path = hf_hub_download(repo_id, "pytorch_model.bin")
            model.load_state_dict(torch.load(path, weights_only=False))
            torch.save(model.state_dict(), "finetuned.pt")
        """
    assert found(fetched, "TK114", "/nowhere/train.py") == [6]


# --- TK107: gradients cleared by hand, optimizers made per iteration, loops over optimizers ---------


def test_tk107_quiet_on_gradients_zeroed_by_hand_and_an_optimizer_made_each_iteration():
    by_hand = """
        import torch
        w = torch.tensor([0.1, -0.2], requires_grad=True)
        optimizer = torch.optim.AdamW([w], lr=0.2)
        for _ in range(100):
            loss = torch.nn.functional.mse_loss(w, torch.zeros(2))
            loss.backward()
            optimizer.step()
            w.grad.zero_()
        """
    assert found(by_hand, "TK107") == []
    fresh = """
        import torch
        def guide(unet, latents, timesteps, lr):
            for t in timesteps:
                x_in = latents.detach().clone().requires_grad_(True)
                opt = torch.optim.SGD([x_in], lr=lr)
                loss = unet(x_in, t).pow(2).mean()
                loss.backward()
                opt.step()
                latents = x_in.detach()
        """
    assert found(fresh, "TK107") == []
    forgotten = by_hand.replace("            w.grad.zero_()\n", "")
    assert found(forgotten, "TK107") == [8]


def test_tk107_quiet_when_zero_grad_runs_over_a_list_of_optimizers():
    text = """
        def train(generator, discriminator, optimizers, loader, loss_fn):
            optimizer_g, optimizer_d = optimizers
            for x in loader:
                for opt in optimizers:
                    opt.zero_grad()
                loss_fn(generator, discriminator, x).backward()
                optimizer_g.step()
                optimizer_d.step()
        """
    assert found(text, "TK107") == []


# --- TK126: a loop that steps with no loss in sight ---------------------------------------------


def test_tk126_quiet_on_an_optimizer_wrapper_and_a_schedule_plotted_by_stepping():
    wrapper = """
        class MultipleOptimizer:
            def __init__(self, optimizers):
                self.optimizers = optimizers
            def step(self):
                for name, optimizer in self.optimizers.items():
                    optimizer.step()
        """
    assert found(wrapper, "TK126") == []
    plot = """
        import torch
        model = torch.nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=100)
        lrs = []
        for _ in range(100):
            optimizer.step()
            lrs.append(scheduler.get_last_lr()[0])
            scheduler.step()
        """
    assert found(plot, "TK126") == []


def test_tk126_follows_the_backward_two_calls_deep_fires_on_a_loss_left_alone():
    text = """
        import torch
        class Agent:
            def learn(self, batch):
                self.optimizer.zero_grad()
                loss = self.compute_loss(batch)
                self.optimizer.step()
                return loss
            def compute_loss(self, batch):
                loss = torch.nn.functional.mse_loss(self.q(batch.obs), batch.target)
                self.backprop(loss)
                return loss
            def backprop(self, loss):
                loss.backward()
        def run(agent, batches, optimizer):
            for batch in batches:
                agent.compute_loss(batch)
                optimizer.step()
        """
    assert found(text, "TK126") == []
    left = """
        import torch
        def train(model, loader, optimizer):
            for x, y in loader:
                optimizer.zero_grad()
                loss = torch.nn.functional.cross_entropy(model(x), y)
                optimizer.step()
        """
    assert found(left, "TK126") == [7]


# --- TK118: only a shuffling sampler of a training run ----------------------------------------------


def test_tk118_quiet_on_an_evaluation_sampler_and_without_shuffle():
    text = """
        import torch
        from torch.utils.data import DataLoader, DistributedSampler
        def main(model, train_set, valid_set, optimizer, epochs):
            train_sampler = DistributedSampler(train_set, shuffle=False)
            valid_sampler = DistributedSampler(valid_set)
            train_loader = DataLoader(train_set, sampler=train_sampler)
            valid_loader = DataLoader(valid_set, sampler=valid_sampler)
            for epoch in range(epochs):
                for x in train_loader:
                    optimizer.zero_grad()
                    model(x).sum().backward()
                    optimizer.step()
        """
    assert found(text, "TK118") == []
    assert found(text.replace("train_set, shuffle=False)", "train_set)"), "TK118") == [5]


def test_tk118_quiet_in_a_script_that_only_evaluates():
    text = """
        import torch
        from torch.utils.data import DataLoader, DistributedSampler
        def decode(model, data):
            sampler = DistributedSampler(data)
            for batch in DataLoader(data, sampler=sampler):
                print(model.generate(batch))
        """
    assert found(text, "TK118") == []


def test_tk123_quiet_on_a_set_of_numbers():
    text = """
        def penalize(lprobs, prev_output_tokens, penalty):
            seen = []
            for i in range(lprobs.shape[0]):
                for token in set(prev_output_tokens[i].tolist()):
                    seen.append(token)
            return {t: i for i, t in enumerate(list({3, 1, 2}))}
        torch.manual_seed(0)
        """
    assert found(text, "TK123") == []  # ints hash to themselves: the same order every run


def test_tk103_quiet_when_moved_after_a_reshape_or_later_and_on_a_host_coin_flip():
    text = """
        import torch
        class SupConLoss(torch.nn.Module):
            def forward(self, features, labels):
                device = features.device
                mask = torch.eye(features.shape[0]).unsqueeze(0).to(device)
                logits_mask = torch.arange(features.shape[0]).view(-1, 1).to(device)
                grid = torch.zeros(features.shape[0], 2)
                if features.is_cuda:
                    grid = grid.cuda()
                return features * mask, logits_mask, grid
        class RandomFlip(torch.nn.Module):
            def forward(self, img):
                if torch.rand(1) < 0.5:
                    return img.flip(-1)
                return img
        """
    assert found(text, "TK103") == []
    left = text.replace("                if features.is_cuda:\n                    grid = grid.cuda()\n", "")
    assert found(left, "TK103") == [8]


def test_tk123_quiet_on_a_check_that_stops_at_the_first_mismatch_fires_when_the_item_is_kept():
    text = """
        import json
        def check(base_dims, base_alphas):
            dims_list = list(set(base_dims.values()))
            all_same_dims = True
            for dims in dims_list:
                if dims != dims_list[0]:
                    all_same_dims = False
                    break
            json.dump(base_alphas, open("alphas.json", "w"))
            return all_same_dims
        """
    assert found(text, "TK123") == []
    kept = text.replace("return all_same_dims", "return dims")
    assert found(kept, "TK123") == [6]  # the item it stopped at depends on the order


def test_tk103_quiet_on_a_coin_flip_inside_a_condition_tk104_on_autograd_function_function():
    dropout = """
        import torch
        class LoConLayer(torch.nn.Module):
            def forward(self, x):
                if (not self.training) or (self.training and torch.rand(1) > self.module_dropout):
                    return self.lora(x)
                return x
        model = LoConLayer().cuda()
        """
    assert found(dropout, "TK103") == []
    flash = MASKED_SOFTMAX.replace("torch.autograd.Function", "torch.autograd.function.Function")
    assert found(flash, "TK104") == []


def test_tk119_quiet_on_a_scheduler_stepped_to_a_count_fires_on_a_bare_step_first():
    text = """
        import torch
        def optimize(model, batches, counter):
            optimizer = torch.optim.Adam(model.parameters())
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda n: min(1.0, n / 1000))
            for batch in batches:
                counter += 1
                scheduler.step(counter)
                optimizer.zero_grad()
                model(batch).mean().backward()
                optimizer.step()
        """
    assert found(text, "TK119") == []
    assert found(text.replace("scheduler.step(counter)", "scheduler.step()"), "TK119") == [8]


def test_tk104_quiet_on_the_evaluation_path_fires_on_the_training_path():
    text = """
        import torch
        class Head(torch.nn.Module):
            def forward(self, x):
                probs = torch.softmax(x, -1)
                if not self.training:
                    probs.masked_fill_(probs < 0.1, 0.0)
                return probs
        """
    assert found(text, "TK104") == []
    assert found(text.replace("if not self.training:", "if self.training:"), "TK104") == [7]


def test_tk103_quiet_on_a_value_read_on_the_host_and_a_factory_given_out():
    text = """
        import torch
        class DiT(torch.nn.Module):
            def forward(self, x, para_cov):
                crop = False if self.rate == 0.0 else torch.rand(1).item() < self.rate
                eye = torch.eye(*para_cov.size(), out=torch.empty_like(para_cov))
                return x, crop, eye
        model = DiT().cuda()
        """
    assert found(text, "TK103") == []


def test_tk125_quiet_on_a_zero_grad_that_skips_the_step_fires_before_the_step():
    text = """
        import torch
        def train(model, loader, optimizer):
            for x in loader:
                loss = model(x).mean()
                loss.backward()
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                if not torch.isfinite(grad_norm):
                    optimizer.zero_grad(set_to_none=True)
                    continue
                optimizer.step()
                optimizer.zero_grad()
        """
    assert found(text, "TK125") == []
    assert found(text.replace("                    continue\n", ""), "TK125") == [9]


def test_tk103_quiet_when_moved_after_indexing_or_a_torch_function_of_it():
    text = """
        import torch
        class CTRL(torch.nn.Module):
            def forward(self, x, new_src, device):
                mask = torch.triu(torch.ones(x.shape[1], x.shape[1]), 1).to(x.device)
                rows = x[torch.arange(x.shape[0])[:, None].to(device), new_src]
                return x.masked_fill(mask.bool(), 0), rows
        model = CTRL().cuda()
        """
    assert found(text, "TK103") == []
