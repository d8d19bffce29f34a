"""Run yunjey/pytorch-tutorial tutorials/02-intermediate/language_model/main.py with its training
loop untouched, at a reduced size, then evaluate the trained model on data/valid.txt.

Its hyper-parameters are module constants: the ones named on the command line (NAME=VALUE,
e.g. hidden_size=256 num_epochs=3) replace their assignment lines before the script runs; the
script sets no seed, so torch.manual_seed(--seed) is called first. The script reads
data/train.txt of the current directory. After it ends, the validation: data/valid.txt tokenized
with the script's dictionary (every word must be in it), laid out as the script lays out training
data (batch_size rows), read in the script's chunks of seq_length with the LSTM state carried
from zeros, model.eval(), no grad; the mean cross-entropy over the chunks is printed.
usage: run_original.py SEED [NAME=VALUE ...]"""

import os
import re
import sys

import torch

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, here)
src = open(os.path.join(here, "main.py")).read()
for kv in sys.argv[2:]:
    k, v = kv.split("=")
    src, n = re.subn(rf"^{k} = .*$", f"{k} = {v}", src, flags=re.M)
    assert n == 1, k
torch.manual_seed(int(sys.argv[1]))
g = {"__name__": "__main__"}
exec(compile(src, os.path.join(here, "main.py"), "exec"), g)

model, corpus, bs, T, L, H = (
    g[k] for k in ("model", "corpus", "batch_size", "seq_length", "num_layers", "hidden_size")
)
w2i = corpus.dictionary.word2idx
toks = [w2i[w] for line in open("data/valid.txt") for w in line.split() + ["<eos>"]]
ids = torch.tensor(toks[: len(toks) // bs * bs]).view(bs, -1)
model.eval()
losses = []
with torch.no_grad():
    states = (torch.zeros(L, bs, H), torch.zeros(L, bs, H))
    for i in range(0, ids.size(1) - T, T):
        out, states = model(ids[:, i : i + T], states)
        losses.append(torch.nn.functional.cross_entropy(out, ids[:, i + 1 : i + 1 + T].reshape(-1)).item())
print(f"FULL val loss {sum(losses) / len(losses):.6f} over {len(losses)} chunks")
