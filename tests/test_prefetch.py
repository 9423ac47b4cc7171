"""DeviceBatches: the windows of Batches for every (step, part), each one prepared before the caller asks for it."""

import numpy as np
import pytest
import torch

from minitrain.data import Batches, DeviceBatches

TOKENS = np.random.default_rng(0).integers(0, 1000, size=5000).astype(np.uint16)
BLOCK, BATCH, SEED = 16, 12, 1


def trainer_order(steps, rank: int, world: int, accum: int) -> list[tuple[int, int, int]]:
    """The requests of one rank's train steps: micro-batch m of rank r is part r*accum + m of world*accum."""
    return [(step, rank * accum + micro, world * accum) for step in steps for micro in range(accum)]


def serve(requests, accum: int, monkeypatch, device=torch.device("cpu")):
    """Each request's (inputs, targets) from a DeviceBatches, and the requests it built, in the order it built them."""
    batches = DeviceBatches(TOKENS, BLOCK, BATCH, SEED, device, grad_accum=accum)
    built = []
    host_windows = batches.host_windows

    def spy(*request):
        built.append(request)
        return host_windows(*request)

    monkeypatch.setattr(batches, "host_windows", spy)
    return [batches.get(*request) for request in requests], built


def assert_same_as_batches(requests, served):
    reference = Batches(TOKENS, BLOCK, BATCH, SEED, torch.device("cpu"))
    for request, (x, y) in zip(requests, served):
        ref_x, ref_y = reference.get(*request)
        assert torch.equal(x.cpu(), ref_x) and torch.equal(y.cpu(), ref_y), request
        assert x.dtype == ref_x.dtype and x.shape == ref_x.shape


@pytest.mark.parametrize("world, accum", [(1, 1), (1, 3), (2, 2), (4, 1)])
def test_in_order_requests_are_the_batches_windows_built_ahead(monkeypatch, world, accum):
    for rank in range(world):
        requests = trainer_order(range(4), rank, world, accum)
        served, built = serve(requests, accum, monkeypatch)
        assert_same_as_batches(requests, served)
        # Only the first request is built when asked; every later one was built while the previous one was used.
        assert built[:-1] == requests and len(built) == len(requests) + 1


@pytest.mark.parametrize("requests, unpredicted", [
    (trainer_order([37, 38, 39], rank=1, world=2, accum=2), 0),  # a resume: only the first is built when asked
    (trainer_order([3], 0, 1, 2) + trainer_order([3, 4], 0, 1, 2), 1),  # a step asked again, e.g. after a retry
    (trainer_order([5], 1, 2, 2) + [(0, 0, 1), (1, 0, 1)] + trainer_order([6], 1, 2, 2), 3),  # another split between
], ids=["resume", "repeat", "other-split"])
def test_unpredicted_requests_are_built_on_the_spot(monkeypatch, requests, unpredicted):
    served, built = serve(requests, 2, monkeypatch)
    assert_same_as_batches(requests, served)
    # One build per request plus the one ahead, and one more for each request that was not the predicted one:
    # after it, the prediction continues from the request, not from the stale guess.
    assert len(built) == len(requests) + 1 + unpredicted


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the side-stream copy and host syncs exist on CUDA only")
def test_cuda_prefetch_is_exact_and_never_syncs(monkeypatch):
    """In-order requests and a resume-like jump, each copy held back behind a long kernel on the copy stream: a
    consumer that did not wait for its copy would read the batch before it lands."""
    requests = trainer_order(range(4), rank=1, world=2, accum=2) + trainer_order([20, 21], rank=1, world=2, accum=2)
    batches = DeviceBatches(TOKENS, BLOCK, BATCH, SEED, torch.device("cuda"), grad_accum=2)
    served = [tuple(t.clone() for t in batches.get(*requests[0]))]  # first-call work: stream, pinned memory
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for request in requests[1:]:
            with torch.cuda.stream(batches.copy_stream):
                torch.cuda._sleep(1_000_000)  # delays the copy that this get stages
            x, y = batches.get(*request)
            served.append((x.clone(), y.clone()))  # read on the compute stream, as a step would
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert_same_as_batches(requests, served)
