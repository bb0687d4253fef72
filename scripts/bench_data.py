"""Data pipeline speed: BPE training, ``swarmd data prepare`` throughput, and shard sampling rate.

On the Python standard library's own sources (the default corpus, present everywhere):

1. ``swarmd tokenizer train``'s work (``train_bpe``) on the first ``--train-bytes`` of them;
2. ``prepare`` of all of them, byte-level and with that BPE: source MB/s and tokens/s;
3. sampling microbatches (``BatchSampler``, ``--microbatch`` windows of ``--seq-len + 1``) from the
   prepared BPE shards, from the same ids in memory, and from a ``--big-gib`` sparse shard (a stream
   far larger than what is read, whose pages are never in the page cache yet: the rate should not
   depend on the shard's size), with the resident-memory growth over the sampling.

Wall-clock rates depend on what else the machine runs: the JSON also gives CPU seconds (every
thread of the process, the tokenizer's pool included) and the 1-minute load average.

One JSON object on stdout with ``--json`` (else a table).

    .venv/bin/python scripts/bench_data.py --json
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from swarmd.finite import strict_json_dumps
from swarmd.train.data import BatchSampler, load_corpus, read_pieces, source_files
from swarmd.train.shards import ShardFile, ShardStream, prepare
from swarmd.train.tokenizer import BYTE_LEVEL, HFTokenizer, Tokenizer, train_bpe, write_tokenizer


def rss() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def bench_train(train_bytes: int, vocab: int, out: Path) -> tuple[HFTokenizer, dict[str, Any]]:
    files, _, _ = source_files(None, 0)
    texts: list[str] = []
    used = 0
    for piece in read_pieces(files):
        if used >= train_bytes:
            break
        data = piece.data[: train_bytes - used]
        used += len(data)
        texts.append(data.decode("utf-8", errors="replace"))
    started, cpu = time.perf_counter(), time.process_time()
    tok = train_bpe(texts, vocab)
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    write_tokenizer(tok, out)
    return HFTokenizer.from_file(out), {"bytes": used, "vocab_size": tok.vocab_size, "seconds": round(seconds, 3),
                                        "cpu_seconds": round(cpu, 3), "mb_per_s": round(used / 1e6 / seconds, 3)}


def bench_prepare(tokenizer: Tokenizer, out: Path) -> dict[str, Any]:
    cpu = time.process_time()
    result = prepare(None, out, tokenizer=tokenizer)
    cpu = time.process_time() - cpu  # every thread's, the tokenizer's pool included: comparable on a busy machine
    return {"source_bytes": result.source_bytes, "tokens": result.tokens, "seconds": round(result.seconds, 3),
            "cpu_seconds": round(cpu, 3), "mb_per_cpu_s": round(result.source_bytes / 1e6 / cpu, 3),
            "mb_per_s": round(result.mb_per_s, 3), "tokens_per_s": round(result.tokens_per_s),
            "bytes_per_token": round(result.source_bytes / result.tokens, 3), "dtype": result.index["dtype"]}


def bench_sampling(data: Any, seq_len: int, microbatch: int, seconds: float) -> dict[str, Any]:
    sampler = BatchSampler(data, seq_len, seed=0)
    sampler.sample(microbatch)
    before = rss()
    n, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        sampler.sample(microbatch)
        n += 1
    elapsed = time.perf_counter() - started
    return {"stream_tokens": data.numel(), "microbatches_per_s": round(n / elapsed, 1),
            "tokens_per_s": round(n * microbatch * seq_len / elapsed),
            "rss_growth_mib": round((rss() - before) / 2**20, 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--train-bytes", type=int, default=8 * 2**20, help="text the BPE is trained on (default 8 MiB)")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--microbatch", type=int, default=8)
    p.add_argument("--sample-seconds", type=float, default=3.0)
    p.add_argument("--big-gib", type=float, default=4.0, help="size of the sparse shard sampled from (GiB)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        tok, trained = bench_train(args.train_bytes, args.vocab_size, work / "tokenizer.json")
        byte_level = bench_prepare(BYTE_LEVEL, work / "bytes")
        bpe = bench_prepare(tok, work / "bpe")
        shards = load_corpus(work / "bpe", seq_len=args.seq_len)
        assert isinstance(shards.train, ShardStream)
        in_memory = torch.from_numpy(np.concatenate([np.fromfile(f.path, dtype=np.uint16).astype(np.int32)
                                                     for f in shards.train.files]))
        big = work / "big.bin"
        tokens = int(args.big_gib * 2**30) // 2
        with open(big, "wb") as fh:
            fh.truncate(tokens * 2)
        sampling = {
            "shards": bench_sampling(shards.train, args.seq_len, args.microbatch, args.sample_seconds),
            "in_memory": bench_sampling(in_memory, args.seq_len, args.microbatch, args.sample_seconds),
            "sparse_big_shard": bench_sampling(ShardStream([ShardFile(big, tokens)], np.dtype(np.uint16)),
                                               args.seq_len, args.microbatch, args.sample_seconds),
        }
    report = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                    "load_1min": round(os.getloadavg()[0], 2)},
        "train_bpe": trained, "prepare_byte_level": byte_level, "prepare_bpe": bpe,
        "sampling": {"seq_len": args.seq_len, "microbatch": args.microbatch, **sampling},
    }
    if args.json:
        print(strict_json_dumps(report))
        return
    print(f"train_bpe: {trained['bytes'] / 2**20:.1f} MiB -> {trained['vocab_size']} tokens in {trained['seconds']} s "
          f"({trained['mb_per_s']} MB/s)")
    for name in ("prepare_byte_level", "prepare_bpe"):
        r = report[name]
        print(f"{name}: {r['source_bytes'] / 2**20:.1f} MiB -> {r['tokens']} {r['dtype']} tokens in {r['seconds']} s: "
              f"{r['mb_per_s']} MB/s, {r['tokens_per_s']} tokens/s")
    for name, r in sampling.items():
        print(f"sampling {name} ({r['stream_tokens']} tokens): {r['microbatches_per_s']} microbatches/s, "
              f"{r['tokens_per_s']} tokens/s, RSS +{r['rss_growth_mib']} MiB")


if __name__ == "__main__":
    main()
