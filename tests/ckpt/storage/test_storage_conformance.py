"""The storage contract, checked on every backend (local path, file://, memory://, S3).

Every backend goes through the same ``Storage`` code path; these tests are what "same
behaviour" means. ``any_root`` (tests/conftest.py) gives one empty root per backend.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

import ckpt
from ckpt.format import crc32c_of
from ckpt.storage import Storage


@pytest.fixture
def storage(any_root) -> Storage:
    url, opts = any_root
    s = Storage(url, opts)
    s.makedirs("")
    return s


def test_write_read_size_exists_delete(storage):
    assert not storage.exists("a/x.bin")
    storage.makedirs("a")
    storage.write_bytes("a/x.bin", b"hello world")
    assert storage.exists("a/x.bin")
    assert storage.size("a/x.bin") == 11
    assert storage.read_bytes("a/x.bin") == b"hello world"
    storage.write_bytes("a/x.bin", b"short")  # overwrite replaces the whole object
    assert storage.read_bytes("a/x.bin") == b"short"
    storage.delete("a/x.bin")
    assert not storage.exists("a/x.bin")
    storage.delete("a/x.bin")  # deleting an absent object is not an error
    with pytest.raises(FileNotFoundError):
        storage.read_bytes("a/x.bin")
    with pytest.raises(FileNotFoundError):
        storage.size("a/nothing.bin")


def test_listdir_files_and_folders(storage):
    assert storage.listdir("") == []
    assert storage.listdir("absent") == []
    storage.makedirs("d/sub")
    storage.write_bytes("d/one.bin", b"1")
    storage.write_bytes("d/two.bin", b"22")
    storage.write_bytes("d/sub/three.bin", b"333")
    entries = sorted(storage.listdir("d"))
    assert entries == [("one.bin", "file", 1), ("sub", "directory", 0), ("two.bin", "file", 2)]
    assert [e[0] for e in storage.listdir("")] == ["d"]
    storage.delete("d", recursive=True)
    assert storage.listdir("d") == []
    assert not storage.exists("d/one.bin")


def test_ranged_reads(storage):
    data = bytes(range(256)) * 40
    storage.write_bytes("r.bin", data)
    assert storage.read_bytes("r.bin", 0, 10) == data[:10]
    assert storage.read_bytes("r.bin", 100, 3000) == data[100:3000]
    assert storage.read_bytes("r.bin", 5000, None) == data[5000:]
    assert storage.read_bytes("r.bin", len(data) - 1, len(data)) == data[-1:]
    assert storage.read_bytes("r.bin", 7, 7) == b""


def test_whole_reads_bounded_by_max_bytes(storage):
    """A whole read names the most the file may hold: within it the file comes back whole
    (an empty one too); beyond it the read is refused naming the file, having read at most
    one byte more; a missing file is still FileNotFoundError."""
    storage.write_bytes("m.json", b"0123456789")
    assert storage.read_bytes("m.json", max_bytes=10) == b"0123456789"
    assert storage.read_bytes("m.json", max_bytes=1 << 20) == b"0123456789"
    with pytest.raises(ckpt.CorruptCheckpointError, match="m.json holds .*more than the 9"):
        storage.read_bytes("m.json", max_bytes=9)
    storage.write_bytes("e.json", b"")
    assert storage.read_bytes("e.json", max_bytes=5) == b""
    with pytest.raises(FileNotFoundError):
        storage.read_bytes("absent.json", max_bytes=5)
    with pytest.raises(ValueError, match="whole read"):
        storage.read_bytes("m.json", 0, 4, max_bytes=5)


def test_empty_files(storage):
    storage.write_bytes("empty.bin", b"")
    assert storage.exists("empty.bin")
    assert storage.size("empty.bin") == 0
    assert storage.read_bytes("empty.bin") == b""
    storage.write_buffers("empty2.bin", [])
    assert storage.size("empty2.bin") == 0
    storage.create_exclusive("empty3.bin", b"")
    assert storage.read_bytes("empty3.bin") == b""


def test_write_buffers_many_kinds(storage):
    floats = np.arange(1000, dtype=np.float32)
    matrix = np.arange(64, dtype=np.int64).reshape(8, 8)
    buffers = [b"head", bytearray(b"-ba-"), memoryview(b"0123456789")[2:7], b"", floats,
               matrix[:, 1],  # not contiguous: written by value
               matrix, torch.arange(5, dtype=torch.int16).numpy(), memoryview(bytes(3000))]
    buffers += [bytes([i]) * (i % 7) for i in range(200)]  # many small ones
    expected = b"".join(np.ascontiguousarray(b).tobytes() if isinstance(b, np.ndarray)
                        else bytes(b) for b in buffers)
    storage.write_buffers("many.bin", buffers)
    assert storage.size("many.bin") == len(expected)
    got = storage.read_bytes("many.bin")
    assert got == expected
    assert crc32c_of([got]) == crc32c_of([memoryview(expected)[:100], memoryview(expected)[100:]])


def test_create_exclusive(storage):
    storage.create_exclusive("commit.json", b"first")
    with pytest.raises(FileExistsError, match="already exists"):
        storage.create_exclusive("commit.json", b"second")
    assert storage.read_bytes("commit.json") == b"first"
    # Finding exactly our bytes there counts as done (an earlier try whose answer was lost).
    storage.create_exclusive("commit.json", b"first")
    # No temporary or lock files are left next to it.
    assert [e[0] for e in storage.listdir("")] == ["commit.json"]


def test_create_exclusive_race_has_one_winner(storage):
    winners, errors = [], []
    barrier = threading.Barrier(6)

    def racer(i):
        barrier.wait()
        try:
            storage.create_exclusive("lease.json", f"writer {i}".encode())
            winners.append(i)
        except FileExistsError:
            pass
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=racer, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(winners) == 1
    assert storage.read_bytes("lease.json") == f"writer {winners[0]}".encode()


def test_replace_if_unchanged(storage):
    assert storage.replace_if_unchanged("lease.json", b"new", b"old") is False  # absent
    assert not storage.exists("lease.json")
    storage.write_bytes("lease.json", b"v1")
    assert storage.replace_if_unchanged("lease.json", b"v2", b"v1") is True
    assert storage.read_bytes("lease.json") == b"v2"
    assert storage.replace_if_unchanged("lease.json", b"v3", b"v1") is False  # stale expected
    assert storage.read_bytes("lease.json") == b"v2"
    assert [e[0] for e in storage.listdir("")] == ["lease.json"]


def test_conditional_writes_compare_whole_records_read_bounded(storage):
    """Each conditional write reads no more of the file in its way than the records it
    compares it with plus one byte: a file that only begins like them is neither."""
    storage.write_bytes("lease.json", b"v1 and more")
    assert storage.replace_if_unchanged("lease.json", b"v1", b"v1") is False
    assert storage.replace_if_unchanged("lease.json", b"v2", b"v1") is False
    assert storage.read_bytes("lease.json") == b"v1 and more"
    with pytest.raises(FileExistsError, match="already exists"):
        storage.create_exclusive("lease.json", b"v1 and")


def test_replace_if_unchanged_race_has_one_winner(storage):
    storage.write_bytes("lease.json", b"v0")
    results, errors = [], []
    barrier = threading.Barrier(5)

    def racer(i):
        barrier.wait()
        try:
            results.append((i, storage.replace_if_unchanged("lease.json", f"w{i}".encode(),
                                                            b"v0")))
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=racer, args=(i,)) for i in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    won = [i for i, ok in results if ok]
    assert len(won) == 1
    assert storage.read_bytes("lease.json") == f"w{won[0]}".encode()


def test_create_exclusive_blocked_while_replacing(storage):
    """The object never disappears during a replace, so a create cannot slip in."""
    storage.write_bytes("lease.json", b"v0")
    stop = threading.Event()
    created = []

    def creator():
        while not stop.is_set():
            try:
                storage.create_exclusive("lease.json", b"intruder")
                created.append(True)
                return
            except FileExistsError:
                pass

    t = threading.Thread(target=creator)
    t.start()
    try:
        current = b"v0"
        for i in range(15):
            new = f"v{i + 1}".encode()
            assert storage.replace_if_unchanged("lease.json", new, current)
            current = new
    finally:
        stop.set()
        t.join()
    assert not created
    assert storage.read_bytes("lease.json") == current


def test_storage_pickles(storage):
    import pickle

    storage.write_bytes("p.bin", b"x")
    clone = pickle.loads(pickle.dumps(storage))
    if storage.url.startswith("memory://"):
        assert clone.url == storage.url  # same process: same in-memory store
    assert clone.read_bytes("p.bin") == b"x"


# -- end to end: save / load / list / verify --------------------------------------------------
class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 4, bias=False)
        self.register_buffer("counts", torch.arange(4, dtype=torch.int64))

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _trained(seed: int):
    torch.manual_seed(seed)
    net = _Net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    for _ in range(2):
        net(torch.randn(5, 8)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    return net, opt


def test_save_load_list_verify_roundtrip(any_root):
    from ckpt.dcp import ModelState

    url, opts = any_root
    net, opt = _trained(0)
    extra = {"step": 7, "name": "run-1", "lr_history": [0.1, 0.05], "pair": (1, "x"),
             "nested": {"ok": True, "none": None, "inf": float("inf")}}
    manifest = ckpt.save({"train": ModelState(net, opt), "extra": extra}, url, 7,
                         storage_options=opts, user_metadata={"loss": 1.5})
    assert manifest is not None and manifest.step == 7

    net2, opt2 = _trained(1)  # different values, same structure
    extra2 = {"step": 0, "name": "", "lr_history": [], "pair": (0, ""),
              "nested": {"ok": False, "none": 1, "inf": 0.0}}
    state = {"train": ModelState(net2, opt2), "extra": extra2}
    loaded = ckpt.load(state, url, 7, storage_options=opts)
    assert loaded.user_metadata == {"loss": 1.5}
    for (k, v), (k2, v2) in zip(net.state_dict().items(), net2.state_dict().items()):
        assert k == k2 and torch.equal(v, v2), k
    s1, s2 = opt.state_dict(), opt2.state_dict()
    for pid in s1["state"]:
        for key, val in s1["state"][pid].items():
            assert torch.equal(torch.as_tensor(val), torch.as_tensor(s2["state"][pid][key]))
    assert state["extra"] == extra

    store = ckpt.CheckpointStore(url, opts)
    infos = store.list(check="full")
    assert [(i.step, i.status) for i in infos] == [(7, "committed")]
    assert infos[0].user_metadata == {"loss": 1.5}
    assert store.verify(7).step == 7
    assert store.committed_steps() == [7]
    assert store.latest().step == 7

    with pytest.raises(FileExistsError, match="already committed"):
        ckpt.save({"extra": extra}, url, 7, storage_options=opts)
    assert store.verify(7).save_id == manifest.save_id  # untouched

    # load_latest picks it; deleting un-commits it.
    assert ckpt.load_latest({"train": ModelState(net2, opt2), "extra": dict(extra2)}, url,
                            storage_options=opts).step == 7
    store.life.delete(7)
    assert store.list() == []
    assert ckpt.load_latest({"extra": dict(extra2)}, url, storage_options=opts) is None


# -- what a root can do: the questions callers ask instead of "which backend?" ---------------
def test_local_path_reaches_the_file_with_os_calls(storage, any_root):
    storage.makedirs("d")
    storage.write_bytes("d/x.bin", b"abc")
    path = storage.local_path("d/x.bin")
    assert (path is not None) == (any_root.kind in ("local", "file"))
    if path is None:
        assert storage.local_path() is None
        with pytest.raises(ValueError, match="not on a local file system"):
            storage.open_local("d/x.bin")
        return
    with open(path, "rb") as f:
        assert f.read() == b"abc"
    with storage.open_local("d/x.bin") as f:
        assert f.read() == b"abc"
    assert storage.local_path("d") == str(Path(path).parent)


def test_has_folders_says_whether_an_empty_folder_exists(storage):
    storage.makedirs("empty/sub")
    assert storage.exists("empty") == storage.has_folders
    assert [e[0] for e in storage.listdir("")] == (["empty"] if storage.has_folders else [])


def test_remove_empty_folder(storage):
    storage.makedirs("d/e")
    storage.write_bytes("d/f.bin", b"1")
    storage.remove_empty_folder("d")  # not empty: left as it is
    assert storage.read_bytes("d/f.bin") == b"1"
    storage.remove_empty_folder("d/e")
    assert [e[0] for e in storage.listdir("d")] == ["f.bin"]
    storage.remove_empty_folder("absent")  # nothing there: no error
    storage.delete("d/f.bin")
    storage.remove_empty_folder("d")
    assert storage.listdir("") == [] and not storage.exists("d")


def test_delete_many(storage):
    storage.makedirs("d")
    storage.makedirs("e")
    for name in ("d/a.bin", "d/b.bin", "d/keep.bin", "e/c.bin"):
        storage.write_bytes(name, b"x")
    storage.delete_many(["d/a.bin", "d/absent.bin", "e/c.bin", "d/b.bin"])  # absent: fine
    assert [e[0] for e in storage.listdir("d")] == ["keep.bin"]
    assert not storage.exists("e/c.bin")
    storage.delete_many([])


def test_location_compares_roots_without_opening_them(any_root, tmp_path):
    url = any_root.url
    here = Storage.location(url)
    assert here.endswith("/") and Storage.location(url + "/") == here
    inside = Storage.location(url.rstrip("/") + "/sub")
    assert inside.startswith(here) and not here.startswith(inside)
    assert not Storage.location(url.rstrip("/") + "-other").startswith(here)
    if any_root.kind in ("local", "file"):  # a path, its file:// URL and a link to it agree
        folder = tmp_path / "root"
        folder.mkdir(exist_ok=True)
        (tmp_path / "link").symlink_to(folder)
        assert {Storage.location(str(folder)), Storage.location(folder.as_uri()),
                Storage.location(str(tmp_path / "link"))} == {here}
