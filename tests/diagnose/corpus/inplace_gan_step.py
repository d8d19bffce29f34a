import torch
import torch.nn as nn

latent_dim = 8


class Generator(nn.Module):
    def __init__(self):
        super(Generator, self).__init__()
        self.model = nn.Sequential(nn.Linear(latent_dim, 32), nn.LeakyReLU(0.2, inplace=True), nn.Linear(32, 16), nn.Tanh())

    def forward(self, z):
        return self.model(z)


class Discriminator(nn.Module):
    def __init__(self):
        super(Discriminator, self).__init__()
        self.model = nn.Sequential(nn.Linear(16, 32), nn.LeakyReLU(0.2, inplace=True), nn.Linear(32, 1), nn.Sigmoid())

    def forward(self, img):
        return self.model(img)


torch.manual_seed(0)
generator, discriminator = Generator(), Discriminator()
adversarial_loss = nn.BCELoss()
optimizer_G = torch.optim.Adam(generator.parameters(), lr=2e-4, betas=(0.5, 0.999))
optimizer_D = torch.optim.Adam(discriminator.parameters(), lr=2e-4, betas=(0.5, 0.999))
real_data = torch.rand(256, 16) * 2 - 1
for i in range(0, 256, 32):
    real_imgs = real_data[i : i + 32]
    valid, fake = torch.ones(32, 1), torch.zeros(32, 1)
    z = torch.randn(32, latent_dim)
    gen_imgs = generator(z)
    g_loss = adversarial_loss(discriminator(gen_imgs), valid)

    optimizer_D.zero_grad()
    real_loss = adversarial_loss(discriminator(real_imgs), valid)
    fake_loss = adversarial_loss(discriminator(gen_imgs.detach()), fake)
    d_loss = (real_loss + fake_loss) / 2
    d_loss.backward()
    optimizer_D.step()

    optimizer_G.zero_grad()
    g_loss.backward()
    optimizer_G.step()
    print("[D loss: %f] [G loss: %f]" % (d_loss.item(), g_loss.item()))
