import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

# distillation: the teacher stays in eval mode without an optimizer; the student's BatchNorm is
# frozen (eval mode, as detection fine-tunes do) while its dropout trains
x = torch.randn(2048, 20)
y = (x[:, :3].sum(1) > 0).long()
loader = DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True)
teacher = nn.Sequential(nn.Linear(20, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Dropout(0.3), nn.Linear(64, 2))
student = nn.Sequential(nn.Linear(20, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 2))
teacher.eval()
optimizer = torch.optim.Adam(student.parameters(), lr=1e-3)
for epoch in range(3):
    student.train()
    student[1].eval()
    for xb, yb in loader:
        soft = torch.softmax(teacher(xb), 1).detach()
        out = student(xb)
        loss = nn.functional.cross_entropy(out, yb) + nn.functional.cross_entropy(out, soft)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print(epoch, loss.item())
