"""The reference a ZeRO-3 example is compared with: the same model, seed, data and optimizer,
trained in this one process without DeepSpeed."""

import pytest
import torch


def train_in_one_process(model, batches, loss_fn, lr):
    """Plain SGD over `batches` of (inputs, targets); the loss and every full gradient of each step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses, grads = [], []
    for inputs, targets in batches:
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, grads


def assert_same_training(got, reference, label=""):
    """Losses equal within 1e-6; at every step, the full gradient of every parameter passes
    assert_close(atol=1e-6, rtol=1e-5), shapes included. `got` is what an example's main() returned."""
    losses, grads = reference
    assert got["losses"] == pytest.approx(losses, abs=1e-6), label
    assert len(got["grads"]) == len(grads), label
    for step, (got_step, want_step) in enumerate(zip(got["grads"], grads)):
        assert got_step.keys() == want_step.keys(), label
        for name, want in want_step.items():
            torch.testing.assert_close(got_step[name], want, rtol=1e-5, atol=1e-6, msg=f"{label} step {step} {name}")
