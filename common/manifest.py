"""A checkpoint folder's manifest: every file with its size and sha256, written last, so that a folder with one is
complete, and a file changed since (a crash mid-write, a bad disk, a copy cut short) is named in one line when the
folder is resumed (common.checkpoint) or loaded as a model (common.models)."""

from __future__ import annotations

import hashlib
import json
import os

from common.args import fail

MANIFEST = "manifest.json"
"""written last into a checkpoint folder: {"step": N, "files": {relative path: {"bytes": n, "sha256": hex}}}"""
SHARDED = "sharded"
"""FSDP2 checkpoints: the torch.distributed.checkpoint folder (model and AdamW shards) inside checkpoint/"""


def sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(path: str, step: int) -> None:
    """Every file of the folder with its size and sha256, written last and atomically: the folder is now complete."""
    files = {}
    for root, _, names in os.walk(path):
        for file in (os.path.join(root, name) for name in names):
            if not os.path.relpath(file, path).startswith(MANIFEST):  # not itself, when a folder's is written again
                files[os.path.relpath(file, path)] = {"bytes": os.path.getsize(file), "sha256": sha256_file(file)}
    with open(os.path.join(path, MANIFEST + ".part"), "w") as f:
        json.dump({"step": step, "files": files}, f, indent=1, sort_keys=True)
    os.replace(os.path.join(path, MANIFEST + ".part"), os.path.join(path, MANIFEST))


def read_manifest(path: str) -> dict | None:
    """The manifest of a checkpoint folder; None when it has none; {} when it cannot be read (check_files says so)."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}
    return manifest if isinstance(manifest, dict) and isinstance(manifest.get("files"), dict) else {}


def check_files(path: str, where: str, model_only: bool = False) -> bool:
    """Check every file a checkpoint folder's manifest lists (size, then sha256; `model_only`: what loading it as a
    model reads, not the trainer and rank states or the FSDP shards): a one-line error naming the first file that is
    missing or differs. False when the folder has no manifest (a model folder, or a checkpoint saved before them)."""
    manifest = read_manifest(path)
    if manifest is None:
        return False
    if not manifest:
        fail(f"{where}: {os.path.join(path, MANIFEST)} is corrupt (it lists the checkpoint's files)")
    for name, want in sorted(manifest["files"].items()):
        if model_only and (name.endswith(".pt") or name.startswith(SHARDED + os.sep)):
            continue
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            fail(f"{where}: {file} is missing")
        if os.path.getsize(file) != want["bytes"]:
            fail(f"{where}: {file} is truncated or corrupt ({os.path.getsize(file)} bytes, {want['bytes']} when saved)")
        if sha256_file(file) != want["sha256"]:
            fail(f"{where}: {file} is corrupt (its sha256 differs from the one saved with it)")
    return True
