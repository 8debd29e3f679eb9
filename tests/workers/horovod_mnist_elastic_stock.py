"""A Horovod elastic training script, moved onto Regatta by changing its import line.

Shaped as Horovod's examples/elastic/pytorch/pytorch_mnist_elastic.py (argparse flags,
hvd.init, DistributedOptimizer, TorchState with epoch and batch, @hvd.elastic.run, a
reset callback that rescales the learning rate, state.commit() every batch), on
scikit-learn's bundled 8x8 digits instead of a download, with Horovod's ElasticSampler
so that a reset re-partitions the samples left. The same file with
``import horovod.torch as hvd`` is tests/workers/horovod_mnist_elastic_stock.py.

    regatta local examples/horovod_mnist_elastic.py --hosts 3 --sigkill 2@40
    horovodrun -np 2 python examples/horovod_mnist_elastic.py --epochs 3
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from sklearn.datasets import load_digits

import horovod.torch as hvd

parser = argparse.ArgumentParser(description="Horovod elastic digits example")
parser.add_argument("--batch-size", type=int, default=32, help="samples per rank and batch")
parser.add_argument("--epochs", type=int, default=5)
parser.add_argument("--lr", type=float, default=0.05, help="learning rate of one worker")
parser.add_argument("--momentum", type=float, default=0.9)
parser.add_argument("--seed", type=int, default=42)
parser.add_argument("--log-interval", type=int, default=10, help="batches between log lines")
parser.add_argument("--fp16-allreduce", action="store_true", help="gradients on the wire as fp16")
args = parser.parse_args()

hvd.init()
torch.manual_seed(args.seed)

digits = load_digits()
images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
labels = torch.tensor(digits.target)
held_out = 300
train_dataset = torch.utils.data.TensorDataset(images[held_out:], labels[held_out:])
test_dataset = torch.utils.data.TensorDataset(images[:held_out], labels[:held_out])

# Horovod: the elastic sampler partitions what is left of the epoch over the current workers.
train_sampler = hvd.elastic.ElasticSampler(train_dataset, seed=args.seed)
train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=args.batch_size,
                                           sampler=train_sampler)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, kernel_size=3, padding=1)
        self.drop = nn.Dropout(0.25)
        self.fc1 = nn.Linear(32 * 2 * 2, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = self.drop(x.flatten(1))
        return F.log_softmax(self.fc2(F.relu(self.fc1(x))), dim=1)


model = Net()
# Horovod: the learning rate grows with the number of workers (the reset callback below
# keeps it so when they change).
optimizer = optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=args.momentum)
compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                     compression=compression)


@hvd.elastic.run
def train(state):
    # entered after every membership change, the state synced across the workers first
    for state.epoch in range(state.epoch, args.epochs + 1):
        state.model.train()
        for batch, (data, target) in enumerate(train_loader):
            state.optimizer.zero_grad()
            loss = F.nll_loss(state.model(data), target)
            loss.backward()
            state.optimizer.step()
            state.sampler.record_batch(batch, args.batch_size)
            state.batch += 1
            if state.batch % args.log_interval == 0 and hvd.rank() == 0:
                print(f"Train epoch {state.epoch} batch {state.batch} workers {hvd.size()} "
                      f"loss {loss.item():.4f}", flush=True)
            state.commit()
        state.sampler.set_epoch(state.epoch + 1)
        state.batch = 0


def metric_average(value, name):
    return hvd.allreduce(torch.tensor(value), name=name).item()


def test():
    model.eval()
    sampler = torch.utils.data.distributed.DistributedSampler(
        test_dataset, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=False)
    loader = torch.utils.data.DataLoader(test_dataset, batch_size=100, sampler=sampler)
    loss, correct = 0.0, 0.0
    with torch.no_grad():
        for data, target in loader:
            output = model(data)
            loss += F.nll_loss(output, target, reduction="sum").item()
            correct += (output.argmax(1) == target).float().sum().item()
    loss = metric_average(loss / len(sampler), "avg_loss")
    accuracy = metric_average(correct / len(sampler), "avg_accuracy")
    if hvd.rank() == 0:
        print(f"Test set: average loss {loss:.4f}, accuracy {100 * accuracy:.2f}%", flush=True)


def on_state_reset():
    for group in optimizer.param_groups:
        group["lr"] = args.lr * hvd.size()


state = hvd.elastic.TorchState(model, optimizer, sampler=train_sampler, epoch=1, batch=0)
state.register_reset_callbacks([on_state_reset])
train(state)
test()
