"""Streaming sources and loaders: exactly once across ranks × workers, resumable (also with a
new grid), batches of any shape, bad samples named, workers that persist, ``auto`` workers."""

from __future__ import annotations

import io
import os

import numpy as np
import pytest
import streamdata
import torch
from torch.utils.data import Dataset, TensorDataset

import torchkeel as tk
from torchkeel.data import EpochLoader, PadCollate, ParquetSource, StreamLoader, WebDatasetSource, tune_workers
from torchkeel.data.order import Unit, continue_position, plan_streams
from torchkeel.data.tune import Trial, choose
from torchkeel.errors import DataError

COLUMNS = ["id", *(f"f{j}" for j in range(streamdata.NUM_FEATURES))]


def make_source(kind: str, root, **kwargs):
    if kind == "parquet":
        return ParquetSource(streamdata.write_parquet(root, **kwargs), input=COLUMNS, target="label")
    return WebDatasetSource(streamdata.write_shards(root, **kwargs), input="npy", target="cls", shuffle_buffer=50)


def ids(batch) -> list[int]:
    return [int(i) for i in batch[0][:, 0].tolist()]


@pytest.mark.parametrize("kind", ["parquet", "webdataset"])
def test_exactly_once_over_2_ranks_x_2_workers_then_resumed_as_1_rank_x_3_workers(tmp_path, kind):
    source = make_source(kind, tmp_path)
    ranks = [StreamLoader(source, 16, seed=1, num_workers=2, rank=r, world_size=2) for r in range(2)]
    streams = [loader.epoch(0) for loader in ranks]
    per_rank: list[list[int]] = [[], []]
    for _ in range(5):  # every rank takes the same number of steps, as under DDP
        for rank, stream in enumerate(streams):
            per_rank[rank] += ids(next(stream))
    assert not set(per_rank[0]) & set(per_rank[1]), "two ranks read the same sample"
    states = [loader.state_dict() for loader in ranks]
    for stream, loader in zip(streams, ranks):
        stream.close()
        loader.close()

    resumed = StreamLoader(source, 16, seed=1, num_workers=3)
    resumed.load_state_dict(states)
    rest = [i for batch in resumed.epoch(0, start_batch=10) for i in ids(batch)]
    seen = per_rank[0] + per_rank[1] + rest
    assert sorted(seen) == list(range(480)), "the epoch was not read exactly once across the segments"
    next_epoch = [i for batch in resumed.epoch(1) for i in ids(batch)]
    assert sorted(next_epoch) == list(range(480)) and next_epoch != seen
    resumed.close()


@pytest.mark.parametrize("kind", ["parquet", "webdataset"])
@pytest.mark.parametrize("stop_after", [3, 8])
def test_a_resume_on_the_same_grid_gives_the_very_same_batches(tmp_path, kind, stop_after):
    source = make_source(kind, tmp_path)
    whole = list(StreamLoader(source, 16, seed=4, num_workers=2).epoch(2))
    first = StreamLoader(source, 16, seed=4, num_workers=2)
    stream = first.epoch(2)
    head = [next(stream) for _ in range(stop_after)]
    state = first.state_dict()
    stream.close()
    again = StreamLoader(source, 16, seed=4, num_workers=2)
    again.load_state_dict(state)
    tail = list(again.epoch(2, start_batch=stop_after))
    assert len(head) + len(tail) == len(whole)
    for got, want in zip(head + tail, whole):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def noisy(sample):
    """An augmentation that draws from the global generators, as people write them."""
    x, y = sample
    noise = torch.rand(x.shape) + float(np.random.rand())
    noise[0] = 0  # column 0 is the sample id
    return x + noise, y


@pytest.mark.parametrize("kind", ["parquet", "webdataset"])
def test_streaming_batches_do_not_depend_on_the_worker_count_and_augment_the_same(tmp_path, kind):
    """0, 1, 2 or 3 workers over 4 streams (3 does not divide 4: the workers pace themselves):
    the very same batches in the same order, augmentations included, and the training
    process's generators never move."""
    source = make_source(kind, tmp_path)
    runs = []
    for workers in (0, 1, 2, 3):
        torch.manual_seed(11)
        loader = StreamLoader(source, 16, seed=5, num_workers=workers, streams=4, transform=noisy)
        runs.append([b for b in loader.epoch(1)])
        after = torch.rand(1)
        torch.manual_seed(11)
        assert torch.equal(after, torch.rand(1)), "the loader moved the global generator"
        loader.close()
    first = runs[0]
    assert sorted(i for b in first for i in ids(b)) == list(range(480))
    for other in runs[1:]:
        assert len(other) == len(first)
        for a, b in zip(first, other):
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_the_ranks_share_the_units_evenly_when_there_are_fewer_units_than_streams():
    units = [Unit(f"u{i}", 80) for i in range(6)]
    fresh = continue_position(None, 0, len(units), 2, 8)
    loads = [sum(80 for _ in stream) for stream in plan_streams(units, 0, fresh, shuffle=True)]
    assert sum(loads[:8]) == sum(loads[8:]) == 240


class Augmented(Dataset):
    """A dataset whose ``__getitem__`` augments with the global generators."""

    def __len__(self):
        return 100

    def __getitem__(self, i):
        return torch.rand(2) + float(np.random.rand()), torch.tensor(i)


@pytest.mark.parametrize("kind", ["parquet", "webdataset"])
def test_a_position_saved_with_batches_read_ahead_reads_them_again(tmp_path, kind):
    """The Trainer reads one group ahead: a checkpoint then must not count it as consumed."""
    source = make_source(kind, tmp_path, corrupt=(7,)) if kind == "webdataset" else make_source(kind, tmp_path)
    whole = [ids(b) for b in StreamLoader(source, 16, seed=2, num_workers=2, streams=3, max_bad_fraction=0.1).epoch(1)]
    loader = StreamLoader(source, 16, seed=2, num_workers=2, streams=3, max_bad_fraction=0.1)
    batches = loader.epoch(1)
    taken = [next(batches) for _ in range(9)]  # 7 trained on, 2 read ahead
    state = loader.state_dict(read_ahead=2)
    batches.close()
    again = StreamLoader(source, 16, seed=2, num_workers=1, streams=3, max_bad_fraction=0.1)
    again.load_state_dict(state)
    rest = [ids(b) for b in again.epoch(1, start_batch=7)]
    assert [ids(b) for b in taken[:7]] + rest == whole


def test_a_position_saved_late_in_a_long_epoch_with_one_batch_read_ahead_reads_it_again(tmp_path):
    """As the Trainer consumes: one batch ahead, each batch dropped once trained on (their memory,
    and ids, are reused), the save after a hundred batches."""
    source = make_source("parquet", tmp_path)
    whole = [ids(b) for b in StreamLoader(source, 4, seed=5, streams=3).epoch(0)]
    loader = StreamLoader(source, 4, seed=5, streams=3)
    batches = loader.epoch(0)
    trained, held = [], next(batches)
    for _ in range(100):
        current, held = held, next(batches)
        trained.append(ids(current))
        del current
    state = loader.state_dict(read_ahead=1)
    batches.close()
    again = StreamLoader(source, 4, seed=5, streams=3)
    again.load_state_dict(state)
    assert trained + [ids(b) for b in again.epoch(0, start_batch=100)] == whole


def test_the_order_and_augmentations_of_map_style_do_not_depend_on_the_worker_count(tmp_path):
    data = TensorDataset(torch.arange(100).float()[:, None], torch.arange(100))
    a = [b[1].tolist() for b in EpochLoader(data, 8, seed=3, num_workers=0).epoch(1)]
    b = [b[1].tolist() for b in EpochLoader(data, 8, seed=3, num_workers=2).epoch(1)]
    assert a == b and sorted(sum(a, [])) == list(range(100))
    runs = []
    for workers in (0, 2):
        torch.manual_seed(4)
        runs.append(list(EpochLoader(Augmented(), 8, seed=3, num_workers=workers).epoch(2)))
        after = torch.rand(1)
        torch.manual_seed(4)
        assert torch.equal(after, torch.rand(1)), "the loader moved the global generator"
    for x, y in zip(*runs):
        assert all(torch.equal(p, q) for p, q in zip(x, y))
    resumed = list(EpochLoader(Augmented(), 8, seed=3, num_workers=2).epoch(2, start_batch=5))
    for x, y in zip(runs[0][5:], resumed):
        assert all(torch.equal(p, q) for p, q in zip(x, y))


def test_parquet_reads_row_groups_with_column_projection_and_names_rows(tmp_path):
    source = make_source("parquet", tmp_path)
    assert len(source.units()) == 12 and all(u.num_samples == 40 for u in source.units())
    assert source.where(1, 5) == f"{tmp_path}/part-0.parquet row 45"
    batch = next(iter(StreamLoader(source, 16, seed=0).epoch(0)))
    assert batch[0].shape == (16, 1 + streamdata.NUM_FEATURES) and batch[0].dtype == torch.float32
    assert batch[1].dtype == torch.int64


class Ragged(Dataset):
    """Dict samples with token sequences of 1 to 12 tokens."""

    def __init__(self, num: int = 64, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.lengths = rng.integers(1, 13, size=num).tolist()
        self.tokens = [torch.from_numpy(rng.integers(1, 20, size=n)) for n in self.lengths]

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int):
        return {"tokens": self.tokens[i], "label": torch.tensor(i % 2), "index": torch.tensor(i)}


def test_pad_collate_pads_to_the_longest_and_adds_a_mask_but_no_other_key():
    data = Ragged(8)
    batch = PadCollate(pad_value=-1)([data[i] for i in range(4)])
    longest = max(data.lengths[:4])
    assert set(batch) == {"tokens", "label", "index", "attention_mask"}  # a strict forward takes it
    assert batch["tokens"].shape == (4, longest)
    assert batch["attention_mask"].sum(dim=1).tolist() == data.lengths[:4]
    assert (batch["tokens"][batch["attention_mask"] == 0] == -1).all()
    assert torch.equal(batch["tokens"][0, : data.lengths[0]], data.tokens[0])
    named = PadCollate(lengths_key="lengths", mask_key=None)([data[i] for i in range(4)])
    assert set(named) == {"tokens", "label", "index", "lengths"} and named["lengths"].tolist() == data.lengths[:4]
    pair = PadCollate()([(torch.ones(2), torch.tensor(0)), (torch.ones(5), torch.tensor(1))])
    assert pair[0].shape == (2, 5) and pair[0].sum() == 7 and pair[1].tolist() == [0, 1]


def hf_samples(lengths, with_mask=False):
    """What a tokenized transformers dataset yields: input_ids, labels (= input_ids), maybe a mask."""
    out = []
    for n in lengths:
        ids = torch.arange(1, n + 1)
        sample = {"input_ids": ids, "labels": ids.clone()}
        if with_mask:
            sample["attention_mask"] = torch.ones(n, dtype=torch.long)
        out.append(sample)
    return out


def test_pad_collate_pads_labels_with_ignore_index_and_keeps_the_users_own_mask():
    batch = PadCollate()(hf_samples([2, 4]))
    assert set(batch) == {"input_ids", "labels", "attention_mask"}
    assert batch["input_ids"].tolist() == [[1, 2, 0, 0], [1, 2, 3, 4]]
    assert batch["labels"].tolist() == [[1, 2, -100, -100], [1, 2, 3, 4]]  # padding is never trained on
    assert batch["attention_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    own = PadCollate(pad_value={"input_ids": 7})(hf_samples([3, 1], with_mask=True))
    assert set(own) == {"input_ids", "labels", "attention_mask"}  # not attention_mask_mask & co
    assert own["input_ids"].tolist() == [[1, 2, 3], [1, 7, 7]] and own["labels"].tolist() == [
        [1, 2, 3],
        [1, -100, -100],
    ]
    assert own["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    chosen = PadCollate(pad_value={"labels": -1, "input_ids": 5})(hf_samples([1, 2]))
    assert chosen["labels"].tolist() == [[1, -1], [1, 2]] and chosen["input_ids"].tolist() == [[1, 5], [1, 2]]
    tags = PadCollate(pad_value=9)([(torch.ones(1), torch.tensor([3])), (torch.ones(2), torch.tensor([1, 2]))])
    assert tags[0].tolist() == [[1, 9], [1, 1]] and tags[1].tolist() == [[3, -100], [1, 2]]


def test_bucketing_cuts_padding_and_keeps_a_seeded_exactly_once_resumable_order():
    data = Ragged(512)
    plain = EpochLoader(data, 16, seed=2, collate_fn=PadCollate())
    bucketed = EpochLoader(data, 16, seed=2, collate_fn=PadCollate(), bucket_by="tokens", bucket_window=256)

    def padding(loader, epoch):
        return sum(int((b["attention_mask"] == 0).sum()) for b in loader.epoch(epoch))

    assert padding(bucketed, 0) < 0.3 * padding(plain, 0)
    order = [b["index"].tolist() for b in bucketed.epoch(1)]
    assert sorted(sum(order, [])) == list(range(512))
    assert order != [b["index"].tolist() for b in bucketed.epoch(2)]
    again = EpochLoader(data, 16, seed=2, collate_fn=PadCollate(), bucket_by="tokens", bucket_window=256)
    assert [b["index"].tolist() for b in again.epoch(1, start_batch=5)] == order[5:]


def test_parquet_bucketing_by_a_list_column(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    seqs = [rng.integers(1, 9, size=int(n)).tolist() for n in rng.integers(1, 30, size=400)]
    pq.write_table(pa.table({"seq": seqs, "label": np.arange(400) % 3}), tmp_path / "s.parquet", row_group_size=200)

    def padding(bucket_by):
        source = ParquetSource(
            str(tmp_path / "s.parquet"), input="seq", target="label", bucket_by=bucket_by, bucket_window=100
        )
        loader = StreamLoader(source, 20, seed=1, collate_fn=PadCollate(), as_samples=True)
        batches = list(loader.epoch(0))
        assert sum(len(b[1]) for b in batches) == 400
        return sum(int((b[0] == 0).sum()) for b in batches)

    assert padding("seq") < 0.3 * padding(None)


def test_a_null_in_a_parquet_row_is_skipped_and_named(tmp_path):
    source = make_source("parquet", tmp_path, null_rows=(7, 300))
    loader = StreamLoader(source, 16, seed=0, max_bad_fraction=0.01)
    seen = [i for batch in loader.epoch(0) for i in ids(batch)]
    assert sorted(seen) == sorted(set(range(480)) - {7, 300})
    named = sorted(where for where, _ in loader.bad.new)
    assert named == [f"{tmp_path}/part-0.parquet row 7", f"{tmp_path}/part-1.parquet row 140"]
    assert all("null" in error for _, error in loader.bad.new)


def test_a_corrupt_sample_in_a_shard_is_skipped_and_named(tmp_path):
    source = make_source("webdataset", tmp_path, corrupt=(85,))
    loader = StreamLoader(source, 16, seed=0, num_workers=2, max_bad_fraction=0.01)
    seen = [i for batch in loader.epoch(0) for i in ids(batch)]
    assert sorted(seen) == sorted(set(range(480)) - {85})
    ((where, error),) = loader.bad.new
    assert where == f"{tmp_path}/train-000001.tar key 000085" and error.startswith("npy: ValueError")
    assert "not a .npy array: no NumPy header (starts with b'not an n')" in error and "pickle" not in error


def test_more_bad_samples_than_max_bad_fraction_stops_with_the_first_ten_listed(tmp_path):
    source = make_source("webdataset", tmp_path, corrupt=tuple(range(0, 480, 20)))
    loader = StreamLoader(source, 16, seed=0, max_bad_fraction=0.02)  # 9.6 allowed, 24 bad
    with pytest.raises(DataError) as caught:
        for _ in loader.epoch(0):
            pass
    message = str(caught.value)
    assert "max_bad_fraction=0.02" in message and "first 10:" in message
    assert message.count(".tar key ") == 10


class Flaky(Dataset):
    def __len__(self):
        return 40

    def __getitem__(self, i):
        if i in (3, 17):
            raise OSError(f"cannot read image {i}.jpg")
        return torch.tensor([float(i)]), torch.tensor(i % 2)


def test_a_map_style_item_that_raises_is_skipped_and_named():
    loader = EpochLoader(Flaky(), 8, seed=0, num_workers=2, max_bad_fraction=0.1)
    seen = sorted(int(v) for x, _ in loader.epoch(0) for v in x[:, 0])
    assert seen == sorted(set(range(40)) - {3, 17})
    assert sorted(loader.bad.new) == [
        ("dataset index 17", "OSError: cannot read image 17.jpg"),
        ("dataset index 3", "OSError: cannot read image 3.jpg"),
    ]
    with pytest.raises(DataError, match="dataset index"):
        list(EpochLoader(Flaky(), 8, seed=0).epoch(0))  # the default 0.001 allows none of 40


def test_the_trainer_records_bad_samples_as_incidents_and_continues(tmp_path):
    config = tk.load_config(
        None,
        [
            f"out_dir={tmp_path}",
            "model.target=streamdata:make_model",
            "data.format=parquet",
            f"data.train={streamdata.write_parquet(tmp_path / 'd', null_rows=(11,))}",
            f"data.input=[{', '.join(COLUMNS)}]",
            "data.target=label",
            "data.max_bad_fraction=0.01",
            "data.num_workers=0",
            "train.batch_size=32",
        ],
    )
    summary = tk.Trainer(config, progress=False).fit()
    assert summary["status"] == "completed" and summary["incidents"] == {"bad_sample": 1}
    rows = tk.read_metrics(tmp_path / "run" / "incidents.jsonl")
    assert rows[0]["where"].endswith("part-0.parquet row 11") and summary["samples"] == 479


class Mislabeled(Dataset):
    def __len__(self):
        return 32

    def __getitem__(self, i):
        return torch.ones(streamdata.NUM_FEATURES + 1), torch.tensor(7 if i == 21 else i % 4)


def test_a_label_out_of_range_is_named_with_the_value_the_classes_and_the_sample(tmp_path):
    config = tk.load_config(
        None, [f"out_dir={tmp_path}", "data.num_workers=0", "train.batch_size=8", "data.shuffle=false"]
    )
    trainer = tk.Trainer(config, model=streamdata.make_model(), train_data=Mislabeled(), progress=False)
    with pytest.raises(DataError) as caught:
        trainer.fit()
    text = "; ".join([str(caught.value), *caught.value.__notes__])
    assert "target 7 is outside [0, 4)" in text and "dataset index 21" in text and "micro-batch 0" in text


class Pid(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return torch.tensor([float(i)]), torch.tensor(os.getpid())


def test_workers_persist_across_epochs():
    loader = EpochLoader(Pid(), 8, seed=0, num_workers=2)
    pids = [{int(p) for _, y in loader.epoch(e) for p in y} for e in range(3)]
    assert pids[0] == pids[1] == pids[2] and len(pids[0]) == 2 and os.getpid() not in pids[0]


def test_stream_workers_persist_across_epochs(tmp_path):
    def with_pid(sample):
        return sample[0], torch.tensor(os.getpid())

    source = make_source("webdataset", tmp_path)
    loader = StreamLoader(source, 16, seed=0, num_workers=2, transform=with_pid)
    pids = [{int(p) for _, y in loader.epoch(e) for p in y} for e in range(2)]
    assert pids[0] == pids[1] and len(pids[0]) == 2 and os.getpid() not in pids[0]


def trial(workers: int, samples_per_s: float) -> Trial:
    return Trial(workers, samples_per_s, rss_bytes=2**28, startup_s=0.1)


@pytest.mark.parametrize(
    "rates, chosen",
    [
        ([9000, 5000, 4000], 0),  # a trivial dataset: workers only add IPC
        ([300, 560, 1000], 2),  # CPU-bound samples: more workers, more throughput
        ([300, 960, 1000], 1),  # within 5 % of the best: the fewer workers win
        ([300, 1000, 990], 1),
        ([0, 0, 0], 0),  # nothing loaded: 0, and training names the bad data
    ],
)
def test_the_choice_is_the_fewest_workers_within_5_percent_of_the_best(rates, chosen):
    result = choose([trial(n, rate) for n, rate in enumerate(rates)])
    assert result.num_workers == chosen and result.reason


def test_the_trial_times_every_candidate_caches_its_choice_and_reuses_it(tmp_path):
    """What the trial measured is the machine's business; that it measured every candidate,
    chose by the rule and kept the choice is this test's."""
    data = TensorDataset(torch.randn(4000, 8), torch.zeros(4000, dtype=torch.long))
    made = []

    def make(n):
        made.append(n)
        return EpochLoader(data, 32, num_workers=n)

    picked = tune_workers(make, fingerprint="data", cache_dir=tmp_path, limit=2, trial_s=0.1)
    assert made == [0, 1, 2] and [t.num_workers for t in picked.trials] == [0, 1, 2]
    assert all(t.samples_per_s > 0 and t.rss_bytes > 0 for t in picked.trials)
    assert picked.num_workers == choose(picked.trials).num_workers and not picked.cached
    cached = tune_workers(
        lambda n: pytest.fail("the cached choice must not run a trial"), fingerprint="data", cache_dir=tmp_path, limit=2
    )
    assert cached.cached and cached.num_workers == picked.num_workers
    fresh = tune_workers(make, fingerprint="other data", cache_dir=tmp_path, limit=1, trial_s=0.05)
    assert not fresh.cached and made[3:] == [0, 1]


def test_a_trial_that_crashes_on_bad_data_leaves_the_error_to_training(tmp_path):
    class Crashes(Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            return torch.ones(3 if i % 2 else 4), torch.tensor(0)  # half and half: no majority to keep

    picked = tune_workers(
        lambda n: EpochLoader(Crashes(), 8, num_workers=n),
        fingerprint="crash",
        cache_dir=tmp_path,
        limit=1,
        trial_s=0.05,
    )
    assert picked.num_workers == 0 and "no batch loaded" in picked.reason
    with pytest.raises(DataError, match="set data.collate=pad"):
        list(EpochLoader(Crashes(), 8).epoch(0))


def test_close_stops_the_workers_even_when_an_error_keeps_the_iterator_alive():
    """A batch that cannot be collated raises in the middle of the epoch; the traceback keeps the
    DataLoader's iterator alive, and close() must still stop its workers there and then."""
    import multiprocessing

    class Crashes(Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            return torch.ones(3 if i % 2 else 4), torch.tensor(0)

    loader = EpochLoader(Crashes(), 8, num_workers=2)
    before = {p.pid for p in multiprocessing.active_children()}
    with pytest.raises(DataError) as caught:
        list(loader.epoch(0))
    workers = [p for p in multiprocessing.active_children() if p.pid not in before]
    assert len(workers) == 2 and caught.value.__traceback__ is not None  # still referenced here
    loader.close()
    assert not any(p.is_alive() for p in workers)


class Slow(Dataset):
    """``work`` units of CPU work per sample (not a sleep: a busy machine slows the step and the
    loading alike, so the share of time spent waiting does not depend on the load)."""

    def __init__(self, work: int) -> None:
        self.work = work

    def __len__(self):
        return 640

    def __getitem__(self, i):
        total = 0
        for k in range(self.work):
            total += k * k
        return torch.ones(streamdata.NUM_FEATURES + 1), torch.tensor(i % 4)


@pytest.mark.parametrize("work", [80_000, 0])
def test_the_input_bound_incident_on_a_slow_dataset_and_none_on_a_fast_one(tmp_path, work):
    config = tk.load_config(
        None,
        [
            f"out_dir={tmp_path}",
            "data.num_workers=0",
            "train.batch_size=8",
            "train.max_steps=60",
            "memory.leak_check=false",
        ],
    )
    summary = tk.Trainer(config, model=streamdata.make_model(), train_data=Slow(work), progress=False).fit()
    if work:
        assert summary["incidents"].get("input_bound") == 1
        (row,) = [r for r in tk.read_metrics(tmp_path / "run" / "incidents.jsonl") if r["kind"] == "input_bound"]
        assert row["wait_fraction"] > 0.5 and "num_workers" in row["message"]
    else:
        assert "input_bound" not in summary["incidents"]


def test_a_list_column_ragged_in_one_row_group_and_regular_in_another_keeps_every_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    seqs = [[1.0, 2.0]] * 6 + [[1.0], [1.0, 2.0, 3.0], [4.0], [5.0, 6.0], [7.0], [8.0]]
    pq.write_table(pa.table({"seq": seqs, "label": np.arange(12)}), tmp_path / "m.parquet", row_group_size=6)
    source = ParquetSource(str(tmp_path / "m.parquet"), input="seq", target="label")
    loader = StreamLoader(source, 4, seed=0, shuffle=False, collate_fn=PadCollate(), as_samples=False)
    batches = list(loader.epoch(0))
    assert sorted(int(v) for b in batches for v in b[1]) == list(range(12))
    assert all(b[0].dim() == 2 for b in batches)


def test_forkserver_workers_follow_each_epochs_plan(tmp_path):
    """The start method used once CUDA is initialized: the plan reaches persistent workers each epoch."""
    source = make_source("parquet", tmp_path)
    loader = StreamLoader(source, 16, seed=2, num_workers=2, start_method="forkserver")
    epochs = [[i for batch in loader.epoch(e) for i in ids(batch)] for e in range(2)]
    assert sorted(epochs[0]) == sorted(epochs[1]) == list(range(480)) and epochs[0] != epochs[1]
    loader.close()


def test_workers_start_with_forkserver_once_cuda_is_initialized(monkeypatch):
    from torchkeel.data.stream import worker_context

    assert worker_context(None) is None or not torch.cuda.is_initialized()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert worker_context(None) == "forkserver" and worker_context("spawn") == "spawn"


def test_streaming_sources_as_train_data_and_val_data_in_the_python_api(tmp_path):
    train = make_source("webdataset", tmp_path / "train")
    val = make_source("webdataset", tmp_path / "val", num=96, shards=2)
    config = tk.load_config(
        None, [f"out_dir={tmp_path}", "data.num_workers=0", "train.batch_size=32", "train.max_epochs=2"]
    )
    summary = tk.Trainer(config, model=streamdata.make_model(), train_data=train, val_data=val, progress=False).fit()
    assert (
        summary["status"] == "completed" and summary["samples"] == 960 and summary["steps"] == 36
    )  # 6 shards of 80: 3 batches each, 2 epochs
    assert 0 <= summary["val_accuracy"] <= 1


@pytest.mark.parametrize("kind", ["parquet", "webdataset"])
def test_shuffle_off_reads_in_file_order(tmp_path, kind):
    loader = StreamLoader(make_source(kind, tmp_path), 16, seed=0, shuffle=False, streams=1)
    assert [i for batch in loader.epoch(3) for i in ids(batch)] == list(range(480))
    several = [
        i
        for batch in StreamLoader(make_source(kind, tmp_path), 16, seed=0, shuffle=False, streams=4).epoch(3)
        for i in ids(batch)
    ]
    assert sorted(several) == list(range(480)) and several[:16] == list(range(16))  # each unit in file order


def test_the_auto_choice_goes_to_metrics_jsonl_and_a_second_run_reuses_it(tiny_config, tmp_path):
    rows = []
    for name in ("first", "second"):
        tk.Trainer(tiny_config(f"name={name}", "train.max_steps=2"), progress=False).fit()
        rows += [r for r in tk.read_metrics(tmp_path / "runs" / name / "metrics.jsonl") if r["kind"] == "data_workers"]
    first, second = rows
    assert first["num_workers"] == second["num_workers"] and first["reason"]
    assert second["cached"] and [t["num_workers"] for t in second["trials"]] == [
        t["num_workers"] for t in first["trials"]
    ]
    assert all(t["samples_per_s"] > 0 and t["rss_bytes"] > 0 for t in first["trials"])


def test_pin_memory_only_with_cuda(tmp_path):
    from torchkeel.config.schema import DataConfig
    from torchkeel.data.build import loader_factory

    data = TensorDataset(torch.zeros(8, 2), torch.zeros(8, dtype=torch.long))
    source = make_source("parquet", tmp_path)
    for device, pinned in ((torch.device("cpu"), False), (torch.device("cuda", 0), True)):
        make = loader_factory(DataConfig(), batch_size=4, seed=0, device=device)
        assert make(data, 0).pin_memory is pinned
        assert make(source, 0).pin_memory is pinned


def test_a_null_label_and_a_row_of_the_wrong_length_are_bad_samples_named_by_file_and_row(tmp_path, capsys):
    """As under ``num_workers: auto`` (the worker trial reads them too): no crash, no float labels,
    no padding of the short row — both skipped and named in every epoch, printed once."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    x, y = streamdata.samples(640)
    rows = [x[i].tolist()[: 8 if i == 33 else None] for i in range(640)]
    labels = [None if i == 17 else int(y[i]) for i in range(640)]
    pq.write_table(
        pa.table({"x": pa.array(rows, type=pa.list_(pa.float32())), "label": pa.array(labels, type=pa.int64())}),
        tmp_path / "data.parquet",
        row_group_size=128,
    )
    config = tk.load_config(
        None,
        [
            f"out_dir={tmp_path}",
            "data.format=parquet",
            f"data.train={tmp_path}/data.parquet",
            "data.input=x",
            "data.target=label",
            "data.max_bad_fraction=0.01",
            "train.max_epochs=2",
            "train.batch_size=32",
        ],
    )
    summary = tk.Trainer(config, model=streamdata.make_model(), progress=False).fit()
    assert summary["status"] == "completed" and summary["samples"] == 2 * 638
    met = [r for r in tk.read_metrics(tmp_path / "run" / "incidents.jsonl") if r["kind"] == "bad_sample"]
    assert sorted((r["where"], r["error"]) for r in met) == sorted(
        [
            (f"{tmp_path}/data.parquet row 17", "a null value in column 'label'"),
            (
                f"{tmp_path}/data.parquet row 33",
                "column 'x' holds 8 values in this row, 9 in the others of its row group",
            ),
        ]
        * 2
    )
    err = capsys.readouterr().err
    assert err.count("skipped a bad sample") == 2 and "4 bad_sample (2 distinct, each printed once)" in err


def test_a_sample_unlike_the_rest_of_its_batch_is_named_not_padded():
    from torchkeel.data.collate import DefaultCollate, collate_or_split

    def name(i):
        return f"sample {i}"

    tokens = [{"input_ids": torch.arange(n), "labels": torch.arange(n)} for n in (3, 5, 2, 4)]
    for where in (0, 2):  # the first sample lacking labels must not make the batch lose them
        samples = tokens[:where] + [{"input_ids": torch.arange(4)}] + tokens[where:]
        batch, bad, keep = collate_or_split(PadCollate(), samples, name)
        assert set(batch) == {"input_ids", "labels", "attention_mask"} and batch["labels"].shape[0] == 4
        assert bad == [
            (
                f"sample {where}",
                "its keys ['input_ids'] differ from the other samples' "
                "['input_ids', 'labels'] in its batch; fix or remove it",
            )
        ]
    vectors = [torch.ones(8)] * 5 + [torch.ones(7)]
    batch, bad, keep = collate_or_split(DefaultCollate(), vectors, name)
    assert batch.shape == (5, 8) and list(keep) == [0, 1, 2, 3, 4]
    assert bad == [("sample 5", "its shape [7] differs from the other samples' [8] in its batch; fix or remove it")]
    with pytest.raises(DataError, match="set data.collate=pad"):  # lengths that vary everywhere: no majority
        collate_or_split(DefaultCollate(), [torch.ones(n) for n in (2, 3, 4, 5)], name)


@pytest.mark.parametrize("kind", ["map", "parquet"])
def test_batch_size_is_the_jobs_batch_for_every_loader(tmp_path, kind):
    """One meaning of ``batch_size``: with 2 ranks of a batch of 16, each rank collates 8, and
    the two ranks' batches of one step are 16 distinct samples."""
    if kind == "map":
        data = TensorDataset(torch.arange(64).float().unsqueeze(1), torch.zeros(64, dtype=torch.long))
        ranks = [EpochLoader(data, 16, seed=3, rank=r, world_size=2) for r in range(2)]
    else:
        source = make_source(kind, tmp_path)
        ranks = [StreamLoader(source, 16, seed=3, rank=r, world_size=2) for r in range(2)]
    firsts = [next(iter(loader.epoch(0))) for loader in ranks]
    for loader, batch in zip(ranks, firsts):
        assert loader.batch_size == loader.options.batch_size == 16
        assert loader.options.rank_batch_size == 8 and len(batch[0]) == 8
    assert len(set(firsts[0][0][:, 0].tolist()) | set(firsts[1][0][:, 0].tolist())) == 16
    for loader in ranks:
        loader.close()


def test_loader_options_name_the_setting_that_is_out_of_range(tmp_path):
    data = TensorDataset(torch.zeros(8, 1), torch.zeros(8, dtype=torch.long))
    with pytest.raises(tk.ConfigError, match="train.batch_size 10 does not divide by the world size 4"):
        EpochLoader(data, 10, world_size=4)
    with pytest.raises(tk.ConfigError, match="batch_size 6 does not divide by the world size 4"):
        StreamLoader(make_source("parquet", tmp_path), 6, world_size=4)
    with pytest.raises(ValueError, match="num_workers must be >= 0, got -1"):
        EpochLoader(data, 4, num_workers=-1)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\), got 2"):
        EpochLoader(data, 4, rank=2, world_size=2)
    with pytest.raises(ValueError, match=r"max_bad_fraction must be in \[0, 1\], got 1.5"):
        EpochLoader(data, 4, max_bad_fraction=1.5)


def test_a_spurious_ast_error_while_reading_a_npy_header_is_read_again(monkeypatch):
    """CPython 3.11 can raise "AST constructor recursion depth mismatch" from the ast.literal_eval
    NumPy reads the header with, when another thread builds an AST at once (CPython issue 106905)."""
    from torchkeel.data.sources import webdataset

    buffer = io.BytesIO()
    np.save(buffer, np.arange(3, dtype=np.float32))
    real_load, calls = np.load, []

    def racing_load(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise SystemError("AST constructor recursion depth mismatch (before=246, after=266)")
        return real_load(*args, **kwargs)

    monkeypatch.setattr(webdataset.np, "load", racing_load)
    assert webdataset._npy(buffer.getvalue()).tolist() == [0.0, 1.0, 2.0] and len(calls) == 2
    calls.clear()
    monkeypatch.setattr(webdataset.np, "load", lambda *a, **k: (_ for _ in ()).throw(SystemError("other")))
    with pytest.raises(SystemError, match="other"):
        webdataset._npy(buffer.getvalue())
