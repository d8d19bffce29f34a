import tempfile

import torch
from transformers import BertConfig, BertForSequenceClassification

torch.manual_seed(0)
config = BertConfig(vocab_size=120, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
with tempfile.TemporaryDirectory() as checkpoint:
    BertForSequenceClassification(config).save_pretrained(checkpoint)
    model = BertForSequenceClassification.from_pretrained(checkpoint)
model.train()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(30):
    input_ids = torch.randint(1, 120, (16, 12))
    labels = (input_ids[:, 0] > 60).long()
    loss = model(input_ids=input_ids, labels=labels).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
print(loss.item())
