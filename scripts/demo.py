"""The local demo: a swarm of swarmd peers on 127.0.0.1, started through the real CLI.

The first peer founds the swarm (and its DHT); the others join it with --join and pick their
stage with --stage auto, one peer per stage. The demo then pushes microbatches of real text (the Python standard library's own source, byte-level)
through every stage's forward and backward over the data plane with 8-bit activations, then
shows each peer's /status. Until the trainer and optimizer steps land (issue #4) nothing
trains: the loss is computed and gradients accumulate, but no peer steps.

    ./scripts/demo                 # run and exit
    ./scripts/demo --serve         # leave the peers running until Ctrl-C
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import httpx
import torch

from swarmd.net import codecs
from swarmd.net.client import DataPlaneClient
from swarmd.pipeline.spec import load_spec


def stdlib_text(limit_bytes: int = 4 << 20, seed: int = 0) -> bytes:
    """Bytes of the standard library's .py sources, in a seed-shuffled file order."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    random.Random(seed).shuffle(files)
    chunks, size = [], 0
    for f in files:
        try:
            data = f.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        size += len(data)
        if size >= limit_bytes:
            break
    return b"\n".join(chunks)


def start_peer(index: int, workdir: Path, *args: str) -> tuple[subprocess.Popen, dict]:
    """One ``swarmd`` subprocess with free ports; waits for its --ready-file."""
    ready = workdir / f"peer{index}.json"
    log_path = workdir / f"peer{index}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "swarmd", "--port", "0", "--api-port", "0", "--dht-port", "0",
             "--threads", "1", "--state-dir", str(workdir / f"peer{index}"), "--ready-file", str(ready), *args],
            stdout=log, stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 120
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            print(log_path.read_text(errors="replace")[-3000:], file=sys.stderr)
            raise SystemExit(f"peer {index} failed to start (log above)")
        time.sleep(0.05)
    return proc, json.loads(ready.read_text())


async def run_microbatches(peers: list[dict], text: bytes, steps: int, batch: int, seq: int, codec: str) -> None:
    codecs.warm_up()  # import bitsandbytes now, not inside the first timed microbatch
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    gen = torch.Generator().manual_seed(0)
    last = len(peers) - 1
    async with DataPlaneClient() as client:
        for i in range(steps):
            starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=gen)
            window = torch.stack([data[s : s + seq + 1] for s in starts.tolist()])
            x, y = window[:, :-1], window[:, 1:]
            t0 = time.perf_counter()
            acts = [x]
            for stage in range(last):  # forward through every stage but the last
                reply = await client.forward(peers[stage]["data_addr"], stage, acts[-1], codec=codec)
                acts.append(reply.tensors["outputs"])
            # the last stage fuses forward and backward: loss and input gradients in one round trip
            reply = await client.backward(peers[last]["data_addr"], last, acts[-1], targets=y, codec=codec)
            loss, grad = reply.meta["loss"], reply.tensors.get("grad_inputs")
            for stage in range(last - 1, -1, -1):
                reply = await client.backward(peers[stage]["data_addr"], stage, acts[stage], grad, codec=codec)
                grad = reply.tensors.get("grad_inputs")
            ms = (time.perf_counter() - t0) * 1e3
            print(f"  microbatch {i + 1}/{steps}: loss {loss:.4f} (ln 256 = 5.545), round trip {ms:.0f} ms")


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM cleans up the children exactly like Ctrl-C


def main() -> int:
    signal.signal(signal.SIGTERM, _interrupt)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="model preset or JSON file (default: tiny)")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--codec", default="8bit", choices=("none", "fp16", "bf16", "8bit"))
    p.add_argument("--serve", action="store_true", help="keep the peers running until Ctrl-C")
    args = p.parse_args()
    spec = load_spec(args.model)
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="swarmd-demo-") as tmp:
        try:
            print(f"starting {spec.n_stages} peers (one per stage of model {spec.name}) through the swarmd CLI ...")
            proc, founder = start_peer(0, Path(tmp), "--model", args.model, "--swarm", "demo")
            procs.append(proc)
            found = [founder]
            print(f"  peer 0 founded swarm 'demo' (DHT on udp://{founder['dht_addr']}) and serves stage {founder['stage']}")
            for i in range(1, spec.n_stages):
                proc, info = start_peer(i, Path(tmp), "--join", founder["dht_addr"], "--swarm", "demo")
                procs.append(proc)
                found.append(info)
                print(f"  peer {i} joined with --join {founder['dht_addr']}; --stage auto chose stage {info['stage']}")
            peers = sorted(found, key=lambda p: p["stage"])
            view = httpx.get(f"http://{founder['api_addr']}/swarm", timeout=10).json()
            listed = sum(len(s["peers"]) for s in view["stages"])
            print(f"  GET /swarm on peer 0 lists {listed} peers: "
                  + ", ".join(f"stage {s['stage']}: {len(s['peers'])}" for s in view["stages"]))
            print(f"\npushing {args.microbatches} microbatches of standard-library source through the pipeline "
                  f"({args.codec} activations):")
            text = stdlib_text()
            asyncio.run(run_microbatches(peers, text, args.microbatches, args.batch_size, spec.seq_len, args.codec))
            print("\nwhat each peer reports (GET /status):")
            for info in peers:
                s = httpx.get(f"http://{info['api_addr']}/status").json()
                print(f"  stage {s['stage']}: state={s['state']} served={s['served']} "
                      f"throughput={s['throughput']:.0f} samples/s grad_samples={s['grad_samples']}")
            print("\nTry it yourself:")
            for info in peers:
                print(f"  curl http://{info['api_addr']}/status")
            if args.serve:
                print("\nPeers keep running; Ctrl-C stops them.")
                while True:
                    time.sleep(3600)
        except KeyboardInterrupt:
            pass
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            codes = [proc.wait(30) for proc in procs]
            print(f"\npeers stopped gracefully (exit codes {codes})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
