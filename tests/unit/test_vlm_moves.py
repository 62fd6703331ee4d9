"""A GRPO group's prompt images cross each (source, destination) pair once: the generate rank
answers each sample's image key, the controller's moves name which samples of a move take an
earlier one's image fields (``Move.alias``), both data planes send those once and the receiver
binds one tensor to every sample of the key. Counted in bytes (``Traffic`` and what ``exchange``
sent), over an in-memory wire standing in for torch.distributed and for MPI."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from rlbatch.data.images import IMAGE_GRID, PIXEL_VALUES, model_inputs
from rlbatch.loop.controller import PendingRollouts, Pipeline, Rollouts
from rlbatch.phases import PHASES
from rlbatch.runtime import mpi_dataplane
from rlbatch.runtime.dataplane import Move, SampleStore, Traffic, exchange
from tests.unit.test_control_scale import Comm, pipeline

GROUP = 8
PATCHES, WIDTH = 16, 1176  # a 56x56 image: 4x4 patches of C*T*P*P = 3*2*14*14 values
IMAGE_BYTES = PATCHES * WIDTH * 4 + 3 * 8  # fp32 pixel_values and the int64 (t, h, w) grid
FIELDS = ["prompt", "response", "behaviour_logprobs", PIXEL_VALUES, IMAGE_GRID]


def generated(first: int, prompts: int, keyed: bool = True) -> tuple[SampleStore, dict[int, tuple[object, ...]]]:
    """A generate rank's store and reply after ``prompts`` groups of ``GROUP`` samples, one image per
    prompt: the samples of a prompt hold the same image tensors (``PromptEncoder`` encodes a prompt
    once). ``keyed``: the reply names each sample's image key (the first sample of its prompt)."""
    store, reply = SampleStore(), dict[int, tuple[object, ...]]()
    for p in range(prompts):
        g = torch.Generator().manual_seed(p)
        pixels = torch.rand(PATCHES * WIDTH, generator=g)
        grid = torch.tensor([1, 4, 4])
        prompt = torch.randint(0, 100, (10 + p,), generator=g)
        for k in range(GROUP):
            sid = first + p * GROUP + k
            response = torch.randint(0, 100, (2 + k,), generator=g)
            for name, value in {"prompt": prompt, "response": response, "behaviour_logprobs": -torch.rand(2 + k),
                                PIXEL_VALUES: pixels, IMAGE_GRID: grid}.items():
                store.put(sid, name, value)
            lengths = {PIXEL_VALUES: PATCHES * WIDTH, IMAGE_GRID: 3}
            reply[sid] = (len(prompt), len(response), (0, 0), None, lengths) + ((first + p * GROUP,) if keyed else ())
    return store, reply


def controller(reply: dict[int, tuple[object, ...]]) -> Pipeline:
    """The controller over ranks 0 (the generate worker), 1 and 2, once it read the generate reply."""
    pipe = pipeline(3, Comm())
    ids = sorted(reply)
    ro = Rollouts(ids, [""] * len(ids), GROUP, {}, {})
    PendingRollouts(pipe, PHASES["generate"], SimpleNamespace(result=lambda: {0: reply}),  # type: ignore[arg-type]
                    {(0,): ids}, ro).result()
    return pipe


class Wire:
    """torch.distributed's isend/irecv between stores of one process: senders post first."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.queue: dict[tuple[int, int], list[torch.Tensor]] = {}
        self.log: list[tuple[int, int, bytes]] = []
        """Every message: (source, destination, its bytes)."""
        self.rank = -1
        monkeypatch.setattr(torch.distributed, "isend", self.isend)
        monkeypatch.setattr(torch.distributed, "irecv", self.irecv)

    def isend(self, buf: torch.Tensor, dst: int) -> None:
        self.queue.setdefault((self.rank, dst), []).append(buf.clone())
        self.log.append((self.rank, dst, buf.numpy().tobytes()))

    def irecv(self, buf: torch.Tensor, src: int) -> None:
        buf.copy_(self.queue[(src, self.rank)].pop(0))

    def run(self, stores: dict[int, SampleStore], moves: list[Move]) -> dict[int, dict[str, float]]:
        out = {}
        for rank in sorted(stores):  # rank 0 holds every sample: it sends first
            self.rank = rank
            out[rank] = exchange(stores[rank], rank, moves)
        assert not any(self.queue.values())
        return out


def text_bytes(store: SampleStore, ids: list[int]) -> int:
    return sum(store.samples[i][f].numel() * 8 for i in ids for f in ("prompt", "response")) + sum(
        store.samples[i]["behaviour_logprobs"].numel() * 4 for i in ids)


def test_a_group_sent_to_one_rank_carries_its_image_once_and_every_sample_gets_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    src, reply = generated(100, 1)
    pipe = controller(reply)
    ids = sorted(reply)
    assert pipe.shares == dict.fromkeys(ids, 100)
    moves = pipe._moves({1: (ids, FIELDS)})
    assert [(m.src, m.dst, m.ids, m.alias) for m in moves] == [(0, 1, ids, [0] * GROUP)]
    traffic = Traffic()
    traffic.add(moves)
    assert traffic.bytes == text_bytes(src, ids) + IMAGE_BYTES  # was + GROUP * IMAGE_BYTES
    assert traffic.messages == 2  # one int64 and one float32 message, as for text
    dst = SampleStore()
    xfer = Wire(monkeypatch).run({0: src, 1: dst}, moves)
    assert xfer[0]["bytes_sent"] == xfer[1]["bytes_received"] == traffic.bytes
    for sid in ids:
        for f in FIELDS:
            assert torch.equal(dst.samples[sid][f], src.samples[sid][f]), (sid, f)
        assert dst.samples[sid][IMAGE_GRID].dtype == torch.long
        inputs = model_inputs(dst.samples[sid])
        assert inputs is not None and inputs[0].shape == (PATCHES, WIDTH) and inputs[1].tolist() == [[1, 4, 4]]
    # one tensor for the whole group on the receiver: its memory is held once
    assert len({dst.samples[sid][PIXEL_VALUES].data_ptr() for sid in ids}) == 1


def test_a_group_split_over_two_ranks_sends_its_image_once_to_each(monkeypatch: pytest.MonkeyPatch) -> None:
    src, reply = generated(0, 2)  # two prompts: two images, two keys
    pipe = controller(reply)
    ids = sorted(reply)
    half = [ids[:4] + ids[8:12], ids[4:8] + ids[12:]]  # each rank gets half of each group
    moves = pipe._moves({1: (half[0], FIELDS), 2: (half[1], FIELDS)})
    traffic = Traffic()
    traffic.add(moves)
    assert traffic.bytes == text_bytes(src, ids) + 2 * 2 * IMAGE_BYTES
    stores = {0: src, 1: SampleStore(), 2: SampleStore()}
    xfer = Wire(monkeypatch).run(stores, moves)
    assert xfer[0]["bytes_sent"] == traffic.bytes == xfer[1]["bytes_received"] + xfer[2]["bytes_received"]
    for r in (1, 2):
        for sid in half[r - 1]:
            for f in FIELDS:
                assert torch.equal(stores[r].samples[sid][f], src.samples[sid][f]), (r, sid, f)
        assert len({stores[r].samples[sid][PIXEL_VALUES].data_ptr() for sid in half[r - 1]}) == 2


def test_samples_without_a_key_move_every_field_as_before() -> None:
    """A reply with no image key (and a text run, which has no image fields) moves each sample's
    fields: the moves carry no alias and count every sample's bytes."""
    src, reply = generated(0, 1, keyed=False)
    pipe = controller(reply)
    ids = sorted(reply)
    assert pipe.shares == {}
    moves = pipe._moves({1: (ids, FIELDS)})
    assert [m.alias for m in moves] == [[]]
    traffic = Traffic()
    traffic.add(moves)
    assert traffic.bytes == text_bytes(src, ids) + GROUP * IMAGE_BYTES
    text = pipe._moves({1: (ids, ["prompt", "response"])})
    assert [(m.ids, m.fields, m.shared, m.alias) for m in text] == [(ids, ["prompt", "response"], [], [])]


def test_the_shared_tensor_stays_until_its_last_sample_is_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    src, reply = generated(0, 1)
    pipe = controller(reply)
    ids = sorted(reply)
    dst = SampleStore()
    Wire(monkeypatch).run({0: src, 1: dst}, pipe._moves({1: (ids, [PIXEL_VALUES])}))
    expect = src.samples[ids[0]][PIXEL_VALUES].clone()
    arrived = dst.samples[ids[0]][PIXEL_VALUES].data_ptr()  # the message's buffer: the image alone
    dst.drop(ids[:-1])
    # the buffer it arrived in is not handed out again while the last sample holds it
    other = dst.recv_pool.take(0, torch.float32, torch.device("cpu"), expect.numel())
    other.fill_(-1.0)
    assert other.data_ptr() != arrived
    assert torch.equal(dst.samples[ids[-1]][PIXEL_VALUES], expect)
    dst.drop(ids[-1:])  # the last one: the buffer is free again
    assert dst.recv_pool.take(0, torch.float32, torch.device("cpu"), expect.numel()).data_ptr() == arrived
    pipe.forget(ids)
    assert pipe.shares == {} and pipe.pending_drop[0] == ids


def test_the_mpi_plane_sends_the_torch_planes_bytes_for_shared_images(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same moves over MPI (a run with no torch world): the same messages, byte for byte, and the
    same samples held, one array for the group."""
    src, reply = generated(0, 1)
    pipe = controller(reply)
    ids = sorted(reply)
    moves = pipe._moves({1: (ids[:5], FIELDS), 2: (ids[5:], FIELDS)})
    wire = Wire(monkeypatch)
    torch_stores = {0: src, 1: SampleStore(), 2: SampleStore()}
    by_torch = wire.run(torch_stores, moves)

    log: list[tuple[int, int, bytes]] = []
    ranks = {"now": 0}

    class FakeComm:
        def Isend(self, buf: np.ndarray, dest: int, tag: int) -> None:  # noqa: N802 (mpi4py's name)
            log.append((ranks["now"], dest, buf.tobytes()))

        def Irecv(self, buf: np.ndarray, source: int, tag: int) -> None:  # noqa: N802
            data = [b for s, d, b in log if (s, d) == (source, ranks["now"])]
            buf[...] = np.frombuffer(data[self.received.setdefault(source, 0)], dtype=buf.dtype)
            self.received[source] += 1

        def __init__(self) -> None:
            self.received: dict[int, int] = {}

    monkeypatch.setattr(mpi_dataplane, "MPI", SimpleNamespace(Request=SimpleNamespace(Testall=lambda reqs: True)))
    mpi_stores = {0: src, 1: SampleStore(), 2: SampleStore()}
    for rank in (0, 1, 2):
        ranks["now"] = rank
        by_mpi = mpi_dataplane.exchange(mpi_stores[rank], rank, moves, FakeComm(), torch.from_numpy)  # type: ignore[arg-type]
        for key in ("bytes_sent", "bytes_received"):
            assert by_mpi[key] == by_torch[rank][key], (rank, key)
    assert log == wire.log
    for r, part in ((1, ids[:5]), (2, ids[5:])):
        for sid in part:
            for f in FIELDS:
                m, t = mpi_stores[r].samples[sid][f], torch_stores[r].samples[sid][f]
                assert m.dtype == t.dtype and np.asarray(m).tobytes() == np.asarray(t).tobytes(), (r, sid, f)
        assert len({mpi_stores[r].samples[sid][PIXEL_VALUES].data_ptr() for sid in part}) == 1


def test_a_move_refuses_an_alias_to_a_later_sample() -> None:
    with pytest.raises(ValueError, match=r"alias \[1, 1\] of 2 samples"):
        Move(0, 1, [5, 6], [PIXEL_VALUES], [[4], [4]], [PIXEL_VALUES], [1, 1])
    with pytest.raises(ValueError, match="shared fields"):
        Move(0, 1, [5, 6], ["prompt"], [[4], [4]], [PIXEL_VALUES], [0, 0])


def png(colour: tuple[int, int, int]) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 8), colour).save(buf, format="PNG")
    return buf.getvalue()


def test_the_generate_rank_answers_each_samples_image_key_and_shares_its_tensors() -> None:
    """Samples of one prompt and image have the key of the first of them and hold the same tensors;
    equal text with another image is another key. A stand-in processor and engine."""
    from rlbatch.data.images import PromptEncoder
    from rlbatch.engines.base import Generation, SamplingParams
    from rlbatch.loop.rank_runtime import RankRuntime

    def processor(text: list[str], images: list[object], return_tensors: str) -> dict[str, torch.Tensor]:
        colour = images[0].getpixel((0, 0))  # type: ignore[attr-defined]
        return {"input_ids": torch.tensor([[1, 2, 3]]), "pixel_values": torch.full((4, 6), float(colour[0])),
                "image_grid_thw": torch.tensor([[1, 2, 2]])}

    engine = SimpleNamespace(generate=lambda prompts, params, images: [Generation([7, 8], [-0.1, -0.2])
                                                                         for _ in prompts])
    rank = SimpleNamespace(store=SampleStore(), engines={"actor_infer": engine}, in_flight=None,
                           image_prompts=PromptEncoder(lambda texts: {"input_ids": [[5] for _ in texts]},
                                                       lambda: processor))  # type: ignore[arg-type,return-value]
    red, blue = png((200, 0, 0)), png((0, 0, 200))
    texts = ["<image>what colour?"] * 4 + ["<image>what colour?"] * 3 + ["1+1="]
    images = [[red]] * 4 + [[blue]] * 3 + [[]]
    ids = list(range(20, 28))
    out = RankRuntime._generate_images(rank, PHASES["generate"], ids, texts, images,  # type: ignore[arg-type]
                                       SamplingParams(max_new_tokens=2))
    assert [out[sid][5] for sid in ids] == [20] * 4 + [24] * 3 + [27]  # type: ignore[misc]
    held = rank.store.samples
    assert len({held[sid][PIXEL_VALUES].data_ptr() for sid in ids[:4]}) == 1
    assert held[20][PIXEL_VALUES][0] == 200.0 and held[24][PIXEL_VALUES][0] == 0.0
    assert held[20][IMAGE_GRID].dtype == torch.long and PIXEL_VALUES not in held[27]


def test_a_text_move_pickles_as_before_moves_could_share() -> None:
    """The phase command of a text run is unchanged: a move with no sharing pickles without the
    share fields, and comes back with them empty."""
    import pickle

    text = Move(0, 1, [3, 4], ["prompt", "response"], [[3, 2], [4, 1]])
    raw = pickle.dumps(text)
    assert b"alias" not in raw and b"shared" not in raw
    assert pickle.loads(raw) == text
    images = Move(0, 1, [3, 4], [PIXEL_VALUES], [[6], [6]], [PIXEL_VALUES], [0, 0])
    assert pickle.loads(pickle.dumps(images)) == images
