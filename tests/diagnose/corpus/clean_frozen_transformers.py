import torch
from transformers import BertConfig, BertForSequenceClassification

torch.manual_seed(0)
model = BertForSequenceClassification(BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64))
for p in model.bert.parameters():
    p.requires_grad = False
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(10):
    ids, labels = torch.randint(0, 100, (4, 12)), torch.randint(0, 2, (4,))
    out = model(input_ids=ids, labels=labels)
    opt.zero_grad()
    out.loss.backward()
    opt.step()
print("ok")
