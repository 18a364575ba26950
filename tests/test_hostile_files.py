"""Hostile files run nothing: a pickle whose ``__reduce__`` calls ``os.system`` (to touch a marker file),
planted in every file curvlab reads (its checkpoints and their shadow state, a nanoGPT ``ckpt.pt``, a
Trainer directory's ``optimizer.pt``, ``scheduler.pt``, ``training_args.bin`` and ``pytorch_model.bin`` (whole
or a shard),
a sharded checkpoint's ``curvlab.json``, a schema-1 ``curvlab.pt``, torch's DCP ``.metadata``, a DCP
byte item and a tensor item, the lr table), is refused by the CLI command and by the library loader
that read it: the marker stays absent, the exit status is 2 and the error one line. So is a ``.metadata``
that would change a class for the whole process, or whose parts aren't torch's, and a corrupt shard.

Issue 48's probes: a config naming code of its own runs none even answered "y"; a safetensors header
that lies (offsets, dtypes, shapes, its own length), a ``trainer_state.json`` or ``architectures`` of the
wrong kind, a pickle that broke the opcode walker, and nanoGPT ``model_args`` far larger than the weights
are each refused in one line; the walker's work is linear in the pickle."""

import dataclasses
import datetime
import io
import json
import math
import os
import pathlib
import pickle
import pickletools
import shlex
import shutil
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.metadata as dcp_metadata
import torch.multiprocessing as mp
from safetensors.torch import load_file
from typer.testing import CliRunner

from curvlab.analysis.sharded import open_sharded_checkpoint
from curvlab.cli import app
from curvlab.errors import CurvlabError
from curvlab.jobs.lr_table import read_lr_table
from curvlab.models.nanogpt import load_nanogpt
from curvlab.runs._dcp_reader import read_metadata
from curvlab.runs.checkpoint import load_checkpoint, read_checkpoint
from curvlab.runs.dcp import convert_to_sharded, read_meta
from curvlab.runs.train import train
from curvlab.util.paths import inside
from curvlab.util.weights_only import _walk
from tests.builders import assert_refused as assert_cli_refuses
from tests.builders import nanogpt_checkpoint, runner, small_config


class Hostile:
    """Unpickled, it runs ``touch MARKER``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(str(self.marker))}",)


def poisoned_copy(src: Path, dst: Path) -> tuple[Path, Path]:
    """A copy of file or directory ``src`` at ``dst``, and the marker path its poison would touch."""
    (shutil.copytree if src.is_dir() else shutil.copy)(src, dst)
    return dst, dst.parent / f"{dst.name}.ran"


def assert_library_refuses(load, *expected) -> str:
    with pytest.raises(CurvlabError) as e:
        load()
    message = str(e.value)
    assert "\n" not in message
    for text in expected:
        assert text in message, message
    return message


REFUSED = "refusing to unpickle it (it could run code)"


@pytest.fixture(scope="module")
def curvlab_run(pcfg_data, tmp_path_factory):
    """A real curvlab run (2 steps, with a shadow state) and its step-2 checkpoint."""
    out = tmp_path_factory.mktemp("hostile") / "run"
    train(small_config(pcfg_data, out, batch_size=4, steps=2, val_windows=8, device="cpu", shadow=True), progress=False)
    return out, out / "ckpt_000002.pt"


@pytest.mark.parametrize("entry", ["scheduler", "shadow"])
def test_a_curvlab_checkpoint_or_its_shadow_state_that_would_run_code_is_refused(curvlab_run, tmp_path, entry):
    run, ckpt = curvlab_run
    payload = torch.load(ckpt, weights_only=True)
    assert entry in payload  # (the run keeps a shadow state: the poison replaces a real entry)
    bad_run, marker = poisoned_copy(run, tmp_path / "run")
    for path in bad_run.glob("ckpt_*.pt"):
        torch.save({**payload, entry: Hostile(marker)}, path)
    bad = bad_run / ckpt.name
    for load in (lambda: load_checkpoint(bad), lambda: read_checkpoint(bad)):
        assert_library_refuses(load, str(bad), "names posix.system", REFUSED, f"it is in {entry!r}")
    assert_cli_refuses(["nds", bad, "--out", tmp_path / "r.json"], str(bad), "names posix.system", REFUSED)
    assert_cli_refuses(["track", bad_run, "--out", tmp_path / "t"], "names posix.system", REFUSED)
    assert not marker.exists()


def test_a_nanogpt_checkpoint_that_would_run_code_is_refused(pcfg_data, tmp_path):
    nanogpt_checkpoint(tmp_path)
    ckpt = tmp_path / "ckpt.pt"
    marker = tmp_path / "ckpt.ran"
    payload = torch.load(ckpt, weights_only=True)
    torch.save({**payload, "optimizer": Hostile(marker)}, ckpt)
    assert_library_refuses(lambda: read_checkpoint(ckpt), str(ckpt), "names posix.system", REFUSED)
    assert_cli_refuses(["nds", ckpt, "--data", pcfg_data, "--out", tmp_path / "r.json"], "names posix.system")
    # and one in torch's legacy (pre-zip) format
    torch.save({**payload, "optimizer": Hostile(marker)}, ckpt, _use_new_zipfile_serialization=False)
    assert_cli_refuses(["nds", ckpt, "--data", pcfg_data], "names posix.system", REFUSED)
    assert not marker.exists()


@pytest.mark.parametrize(
    "name,expected",
    [
        ("optimizer.pt", "names posix.system"),
        ("scheduler.pt", "names posix.system"),
        ("training_args.bin", "holds ['posix.system']"),
        ("pytorch_model.bin", "a weights file (pytorch_model*.bin) names posix.system"),
    ],
)
def test_a_trainer_file_that_would_run_code_is_refused(trainer_checkpoint, tmp_path, name, expected):
    path, data = trainer_checkpoint
    bad, marker = poisoned_copy(path, tmp_path / "ckpt")
    if name == "pytorch_model.bin":  # (an older checkpoint's weights file: transformers unpickles it)
        (bad / "model.safetensors").unlink()
        torch.save({"transformer.wte.weight": Hostile(marker)}, bad / name)
    elif name == "training_args.bin":
        torch.save(Hostile(marker), bad / name)
    else:
        torch.save({**torch.load(path / name, weights_only=True), "state": Hostile(marker)}, bad / name)
    assert_library_refuses(lambda: read_checkpoint(bad), expected, "unpickle it")
    assert_cli_refuses(["nds", bad, "--data", data, "--out", tmp_path / "r.json"], expected, "unpickle it")
    assert not marker.exists()


def test_a_pytorch_model_bin_of_plain_tensors_still_loads(trainer_checkpoint, tmp_path):
    """The refusal is of the poison, not of the format: the same directory with honest
    ``pytorch_model.bin`` weights reads."""
    path, _ = trainer_checkpoint
    good, _ = poisoned_copy(path, tmp_path / "ckpt")
    ref = read_checkpoint(path).payload.model
    (good / "model.safetensors").unlink()
    torch.save(ref.state_dict(), good / "pytorch_model.bin")
    model = read_checkpoint(good).payload.model
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), ref.state_dict().values()))


def sharded_copy(path: Path, out: Path) -> Path:
    """The Trainer checkpoint with its weights saved as Hugging Face saves a model above its shard size:
    ``model-0000k-of-0000N.safetensors`` and ``model.safetensors.index.json``, no ``model.safetensors``."""
    shutil.copytree(path, out)
    (out / "model.safetensors").unlink()
    read_checkpoint(path).payload.model.save_pretrained(out, max_shard_size="4KB")
    return out


def test_sharded_safetensors_read_as_the_whole_model(trainer_checkpoint, tmp_path):
    path, data = trainer_checkpoint
    sharded = sharded_copy(path, tmp_path / "sharded")
    assert not (sharded / "model.safetensors").exists() and len(list(sharded.glob("model-*.safetensors"))) > 2
    whole, parts = read_checkpoint(path).payload.model, read_checkpoint(sharded).payload.model
    assert whole.state_dict().keys() == parts.state_dict().keys()
    assert all(torch.equal(a, parts.state_dict()[k]) for k, a in whole.state_dict().items())
    reports = {}
    for name, ckpt in (("whole", path), ("sharded", sharded)):
        out = tmp_path / f"{name}.json"
        r = CliRunner().invoke(app, ["nds", str(ckpt), "--data", str(data), "--out", str(out)])
        assert r.exit_code == 0, r.output
        reports[name] = json.loads(out.read_text())
    for key in ("nds", "first_order", "curvature_penalty", "realized", "hidden", "blocks"):
        assert reports["whole"][key] == reports["sharded"][key], key


def bin_sharded_copy(path: Path, out: Path, model) -> Path:
    """The Trainer checkpoint with ``model``'s weights as transformers 4 saved them with
    ``safe_serialization=False`` above the shard size: ``pytorch_model-0000k-of-0000N.bin`` and
    ``pytorch_model.bin.index.json``, no ``model.safetensors`` (transformers 5's ``save_pretrained`` writes
    safetensors only, so the shards are split here as 4 split them, by huggingface_hub)."""
    from huggingface_hub import split_torch_state_dict_into_shards

    shutil.copytree(path, out)
    (out / "model.safetensors").unlink()
    model.config.save_pretrained(out)
    weights = model.state_dict()
    split = split_torch_state_dict_into_shards(
        weights, filename_pattern="pytorch_model{suffix}.bin", max_shard_size="4KB"
    )
    for shard, names in split.filename_to_tensors.items():
        torch.save({n: weights[n].contiguous() for n in names}, out / shard)
    index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
    (out / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    return out


def test_sharded_pytorch_model_bin_read_as_the_whole_model(trainer_checkpoint, tmp_path):
    """A float64 model's weights in ``.bin`` shards read as the model held whole and as its single
    ``model.safetensors``: the same tensors bit for bit, the same report; the shards are unpickled with
    ``weights_only=True``, so a shard that would run code is refused."""
    path, data = trainer_checkpoint
    model = read_checkpoint(path).payload.model.double()
    whole = tmp_path / "whole"
    shutil.copytree(path, whole)
    model.save_pretrained(whole)
    sharded = bin_sharded_copy(path, tmp_path / "sharded", model)
    shards = sorted(sharded.glob("pytorch_model-*.bin"))
    assert len(shards) >= 2 and not list(sharded.glob("*.safetensors"))
    parts, held = read_checkpoint(sharded).payload.model.state_dict(), model.state_dict()
    assert parts.keys() == held.keys()
    assert all(v.dtype == parts[k].dtype == torch.float64 and torch.equal(parts[k], v) for k, v in held.items())
    reports = {}
    for name, ckpt in (("whole", whole), ("sharded", sharded)):
        out = tmp_path / f"{name}.json"
        r = CliRunner().invoke(app, ["nds", str(ckpt), "--data", str(data), "--dtype", "float64", "--out", str(out)])
        assert r.exit_code == 0, r.output
        reports[name] = json.loads(out.read_text())
    for key in ("nds", "first_order", "curvature_penalty", "realized", "hidden", "blocks"):
        assert reports["whole"][key] == reports["sharded"][key], key
    # a shard holding a pickle that would run code, among the tensors
    bad, marker = poisoned_copy(sharded, tmp_path / "bad")
    torch.save({**torch.load(shards[1], weights_only=True), "x": Hostile(marker)}, bad / shards[1].name)
    expected = "a weights file (pytorch_model*.bin) names posix.system"
    assert_library_refuses(lambda: read_checkpoint(bad), expected, REFUSED)
    assert_cli_refuses(["nds", bad, "--data", data, "--out", tmp_path / "r.json"], expected, REFUSED)
    assert not marker.exists()


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda index, d: {**index, "weight_map": {k: "../outside.safetensors" for k in index["weight_map"]}},
         "names shard '../outside.safetensors', not a file of this directory"),
        (lambda index, d: (d / sorted(set(index["weight_map"].values()))[0]).unlink() or index, "which is missing"),
        (lambda index, d: {"weight_map": []}, "not a readable shard index"),
    ],
    ids=["outside", "missing", "garbled"],
)  # fmt: skip
def test_a_shard_index_naming_what_is_not_there_is_refused(trainer_checkpoint, tmp_path, change, expected):
    path, data = trainer_checkpoint
    bad = sharded_copy(path, tmp_path / "bad")
    index_file = bad / "model.safetensors.index.json"
    index_file.write_text(json.dumps(change(json.loads(index_file.read_text()), bad)))
    assert_library_refuses(lambda: read_checkpoint(bad), expected)
    assert_cli_refuses(["nds", bad, "--data", data, "--out", tmp_path / "r.json"], expected)


# --- sharded checkpoints -------------------------------------------------------------------------------


def _poison_old_meta(ckpt: Path, marker: Path) -> None:
    """A schema-1 directory: its metadata a pickled curvlab.pt (here one that would run code)."""
    (ckpt / "curvlab.json").unlink()
    torch.save({"format": "curvlab-dcp", "schema_version": 1, "rng": Hostile(marker)}, ckpt / "curvlab.pt")


def _poison_json_meta(ckpt: Path, marker: Path) -> None:
    (ckpt / "curvlab.json").write_bytes(pickle.dumps(Hostile(marker)))


def _poison_metadata(ckpt: Path, marker: Path) -> None:
    """torch's real .metadata, with one more attribute: the poison."""
    metadata = read_metadata(ckpt)
    metadata.planner_data = {"x": Hostile(marker)}
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))


def _repoint(ckpt: Path, fqn: str, content: bytes) -> None:
    """Append ``content`` to the .distcp file holding item ``fqn`` and point the .metadata's entry at it."""
    metadata = read_metadata(ckpt)
    key = next(k for k in metadata.storage_data if k.fqn == fqn)
    info = metadata.storage_data[key]
    file = ckpt / info.relative_path
    offset = file.stat().st_size
    with open(file, "ab") as f:
        f.write(content)
    metadata.storage_data[key] = dataclasses.replace(info, offset=offset, length=len(content))
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))


def _torch_saved(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _poison_byte_item(ckpt: Path, marker: Path) -> None:
    """One of the optimizer's param-group values (a DCP byte item), replaced by the poison."""
    _repoint(ckpt, "optimizer.param_groups.0.lr", _torch_saved(Hostile(marker)))


def _poison_tensor_item(ckpt: Path, marker: Path) -> None:
    _repoint(ckpt, "model.transformer.wte.weight", _torch_saved(Hostile(marker)))


def _corrupt_tensor_item(ckpt: Path, marker: Path) -> None:
    """No code: a tensor item whose bytes are a broken zip (torch's reader fails on them)."""
    _repoint(ckpt, "model.transformer.wte.weight", b"PK\x03\x04" + bytes(200))


OUTSIDE = "../" * 2 + "outside.distcp"  # (two levels up; spelt so, the docs test flags a literal)


def _poison_shard_path(ckpt: Path, marker: Path) -> None:
    """No code: a .metadata that sends torch's reader to a file outside the checkpoint."""
    metadata = read_metadata(ckpt)
    key = next(iter(metadata.storage_data))
    metadata.storage_data[key] = dataclasses.replace(metadata.storage_data[key], relative_path=OUTSIDE)
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))


SHARDED = {
    "old curvlab.pt": (_poison_old_meta, "written by an older curvlab"),
    "curvlab.json": (_poison_json_meta, "corrupt JSON"),
    ".metadata": (_poison_metadata, f"names 'posix.system', not only torch's checkpoint metadata; {REFUSED}"),
    "byte item": (
        _poison_byte_item,
        f"byte item 'optimizer.param_groups.0.lr' names posix.system, not only tensors and plain data; {REFUSED}",
    ),
    "tensor item": (
        _poison_tensor_item,
        f"a tensor in a shard names posix.system, not only tensors and plain data; {REFUSED}",
    ),
    "shard outside": (_poison_shard_path, f"names {OUTSIDE!r}, which lies outside"),
    "corrupt tensor": (_corrupt_tensor_item, "corrupt shard: torch failed reading a tensor item in it (RuntimeError)"),
}
NEED_A_GROUP = ("byte item", "tensor item", "corrupt tensor")  # read by dcp.load, after the model is sharded


def _probe(ckpt: Path, name: str, out: Path) -> dict:
    bad, marker = poisoned_copy(ckpt, out / name.replace(" ", "-"))
    SHARDED[name][0](bad, marker)
    try:
        open_sharded_checkpoint(bad)
        library = None
    except CurvlabError as e:
        library = str(e)
    r = runner.invoke(app, ["nds", str(bad), "--fsdp", "--out", str(out / f"{bad.name}.json")])
    return {"library": library, "exit": r.exit_code, "output": r.output, "ran": marker.exists()}


def _sharded_worker(rank, tmp, world, ckpt):
    """One rank under a gloo group: write the sharded checkpoint, then probe every poison in it."""
    tmp = Path(tmp)
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp / 'store'}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    try:
        convert_to_sharded(load_checkpoint(ckpt), tmp / "sharded")
        results = {name: _probe(tmp / "sharded", name, tmp / "grouped") for name in SHARDED}
        (tmp / "results.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


@pytest.mark.heavy
def test_a_sharded_checkpoint_that_would_run_code_is_refused(curvlab_run, tmp_path):
    _, ckpt = curvlab_run
    (tmp_path / "grouped").mkdir()
    mp.spawn(_sharded_worker, args=(str(tmp_path), 1, str(ckpt)), nprocs=1, join=True)
    assert read_meta(tmp_path / "sharded")["world_size"] == 1  # (the real checkpoint reads)
    grouped = json.loads((tmp_path / "results.json").read_text())
    (tmp_path / "alone").mkdir()
    for name, (_, expected) in SHARDED.items():
        # under a process group (every reader, dcp.load included), and in one process without one
        # (the readers before the model is sharded; the route to the code)
        results = [grouped[name]] + (
            [] if name in NEED_A_GROUP else [_probe(tmp_path / "sharded", name, tmp_path / "alone")]
        )
        for got in results:
            assert not got["ran"], name
            assert got["library"] is not None and "\n" not in got["library"] and expected in got["library"], got
            lines = got["output"].strip().splitlines()
            assert got["exit"] == 2 and len(lines) == 1 and lines[0].startswith("error:"), got
            assert expected in lines[0], got


# --- torch's .metadata: what it may build, and its parts ------------------------------------------------

# pickle's BUILD on a class object (not an instance): pathlib.PosixPath.is_relative_to = StorageMeta (a
# truthy class), for the whole process, which the C unpickler does (with only its globals vetted)
_SET_A_CLASS = (
    b"\x80\x02cpathlib\nPosixPath\nN}X\x0e\x00\x00\x00is_relative_to"
    b"ctorch.distributed.checkpoint.metadata\nStorageMeta\ns\x86b."
)
_REAL_IS_RELATIVE_TO = pathlib.PosixPath.is_relative_to


def test_the_build_on_a_class_probe_changes_the_class_for_the_whole_process():
    """The probe is real: the C unpickler changes the class (undone here at once)."""
    try:
        assert pickle.loads(_SET_A_CLASS) is pathlib.PosixPath
        assert pathlib.PosixPath.is_relative_to is dcp_metadata.StorageMeta
    finally:
        del pathlib.PosixPath.is_relative_to
    assert pathlib.PosixPath.is_relative_to is _REAL_IS_RELATIVE_TO


@pytest.mark.parametrize(
    "pickled,expected",
    [
        (_SET_A_CLASS, "would change the class pathlib.PosixPath"),
        # BUILD on torch's own metadata class, an enum member (one object for the whole process), and a
        # dunder attribute of a metadata instance
        (
            b"\x80\x02ctorch.distributed.checkpoint.metadata\nMetadata\nN}X\x01\x00\x00\x00xK\x01s\x86b.",
            "would change the class torch.distributed.checkpoint.metadata.Metadata",
        ),
        (
            b"\x80\x02ctorch.distributed.checkpoint.metadata\n_MEM_FORMAT_ENCODING\nK\x00\x85R}X\x06\x00\x00\x00_name_X\x01\x00\x00\x00xs"
            b"b.",
            "would change a torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING",
        ),
        (
            b"\x80\x02ctorch.distributed.checkpoint.metadata\nStorageMeta\n)\x81N}X\x09\x00\x00\x00__class__"
            b"cpathlib\nPosixPath\ns\x86b.",
            "would change the attributes ['__class__'] of a torch.distributed.checkpoint.metadata.StorageMeta",
        ),
        # SETITEM on a class (its __dict__ is no dict)
        (b"\x80\x02cpathlib\nPosixPath\nX\x01\x00\x00\x00xK\x01s.", "would change the class pathlib.PosixPath"),
    ],
)
def test_a_metadata_that_would_change_a_class_is_refused(tmp_path, pickled, expected):
    (tmp_path / ".metadata").write_bytes(pickled)
    assert_library_refuses(lambda: read_metadata(tmp_path), str(tmp_path / ".metadata"), expected, "refusing")
    assert pathlib.PosixPath.is_relative_to is _REAL_IS_RELATIVE_TO
    assert vars(dcp_metadata.Metadata).get("x") is None
    assert dcp_metadata._MEM_FORMAT_ENCODING(0).name == "TORCH_CONTIGUOUS_FORMAT"
    with pytest.raises(CurvlabError, match="outside"):
        inside(tmp_path, "../x", "src")


@pytest.fixture(scope="module")
def dcp_directory(tmp_path_factory):
    """A real DCP directory (torch's writer, one process): a tensor item and a byte item."""
    path = tmp_path_factory.mktemp("dcp")
    with warnings.catch_warnings():  # (that it saves in one process, without a process group: meant)
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.save({"w": torch.zeros(2, 3), "lr": 0.1}, checkpoint_id=path)
    return path


def _index(metadata, fqn):
    return next(k for k in metadata.storage_data if k.fqn == fqn)


def _bad_storage_item(metadata, **fields):
    key = _index(metadata, "w")
    metadata.storage_data[key] = dataclasses.replace(metadata.storage_data[key], **fields)


@pytest.mark.parametrize(
    "malform,expected",
    [
        (lambda m: setattr(m, "storage_data", [1]), "its storage_data is a list"),
        (lambda m: setattr(m, "storage_data", 5), "its storage_data is 5"),
        (lambda m: setattr(m, "storage_data", "x"), "its storage_data is 'x'"),
        (lambda m: setattr(m, "storage_data", {"w": 1}), "a storage_data key is 'w', not a MetadataIndex"),
        (lambda m: m.storage_data.update({_index(m, "w"): 7}), "storage item 'w' is 7, not a _StorageInfo"),
        (lambda m: _bad_storage_item(m, relative_path=5), "storage item 'w''s relative_path is 5"),
        (lambda m: _bad_storage_item(m, offset=-1), "storage item 'w''s offset is -1, not an int >= 0"),
        (lambda m: _bad_storage_item(m, length="3"), "storage item 'w''s length is '3'"),
        (lambda m: setattr(m, "state_dict_metadata", [1]), "its state_dict_metadata is a list"),
        (lambda m: m.state_dict_metadata.update({"w": 1}), "entry 'w' is 1, not tensor or bytes metadata"),
        (lambda m: setattr(m.state_dict_metadata["w"], "size", [2, 3]), "entry 'w''s size is a list"),
        (lambda m: setattr(m.state_dict_metadata["w"], "chunks", [1]), "a chunk of 'w' is 1"),
        (lambda m: setattr(m, "storage_meta", 5), "its storage_meta is 5, not None or a StorageMeta"),
    ],
)
def test_a_metadata_whose_parts_are_not_torchs_is_refused(dcp_directory, tmp_path, malform, expected):
    read_metadata(dcp_directory)  # (the real one reads)
    bad = tmp_path / "dcp"
    shutil.copytree(dcp_directory, bad)
    metadata = read_metadata(bad)
    malform(metadata)
    (bad / ".metadata").write_bytes(pickle.dumps(metadata))
    assert_library_refuses(lambda: read_metadata(bad), f"{bad / '.metadata'}: {expected}", "not DCP metadata")


# --- the lr table ---------------------------------------------------------------------------------------


def test_an_lr_table_that_would_run_code_is_refused(tmp_path):
    """The lr table is JSON (read by curvlab.util.schema): a pickle in its place is no table."""
    table, marker = tmp_path / "lr_table.json", tmp_path / "lr_table.ran"
    table.write_bytes(pickle.dumps(Hostile(marker)))
    assert_library_refuses(lambda: read_lr_table(table), str(table), "corrupt JSON")
    assert not marker.exists()


# --- issue 48: code a config names, lying safetensors headers, JSON of the wrong kind, nanoGPT sizes -----


def fresh_cli_refuses(args: list, tmp_path: Path, stdin: str = "") -> str:
    """``python -m curvlab ARGS`` in a process of its own (``stdin`` on its standard input; transformers' cache
    in ``tmp_path``): exit status 2 and one line in all, an ``error:`` line, which is returned."""
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "curvlab", *map(str, args)]
    r = subprocess.run(command, input=stdin, capture_output=True, text=True, env=env)
    lines = (r.stdout + r.stderr).strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error:"), r.stdout + r.stderr
    return lines[0]


def test_a_config_naming_code_of_its_own_runs_none_when_answered_yes(trainer_checkpoint, tmp_path):
    """transformers asks "[y/N]" before it runs a config's own code unless told not to: with "y" on standard
    input, such a checkpoint directory and such a --config are refused, run nothing and write nothing."""
    path, data = trainer_checkpoint
    bad, marker = poisoned_copy(path, tmp_path / "ckpt")
    config = {**json.loads((bad / "config.json").read_text()), "model_type": "own-gpt"}
    config["auto_map"] = {"AutoConfig": "own.OwnConfig", "AutoModelForCausalLM": "own.OwnModel"}
    (bad / "config.json").write_text(json.dumps(config))
    (bad / "own.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    torch.save(load_file(path / "model.safetensors"), tmp_path / "w.pt")  # (a state dict, for --config)
    files = sorted((p, p.read_bytes()) for p in tmp_path.rglob("*") if p.is_file())
    line = fresh_cli_refuses(["nds", bad, "--data", data, "--out", tmp_path / "r.json"], tmp_path, "y\n")
    assert "names classes of its own (auto_map)" in line
    options = ["--config", str(bad), "--optimizer", "adamw", "--batch-size", "4", "--out", str(tmp_path / "r.json")]
    r = runner.invoke(app, ["nds", str(tmp_path / "w.pt"), "--data", str(data), *options], input="y\n")
    assert r.exit_code == 2 and r.output.count("\n") == 1 and "not a config this transformers builds" in r.output
    assert not marker.exists()
    assert sorted((p, p.read_bytes()) for p in tmp_path.rglob("*") if p.is_file()) == files


def lying(change):
    """A change of a safetensors file's header (``change(header, tensors by offset)``), its data kept."""

    def rewrite(path: Path) -> None:
        raw = path.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8 : 8 + n])
        change(header, sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"]))
        text = json.dumps(header).replace('"INF"', "Infinity").encode()  # (JSON as Python reads it)
        path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n :])

    return rewrite


def claiming_ten_gigabytes(path: Path) -> None:
    """A sparse 10 GB file whose header says it is 10 GB long (read whole, it was a MemoryError)."""
    with open(path, "wb") as f:
        f.write((10 * 2**30 - 8).to_bytes(8, "little") + b"{")
        f.truncate(10 * 2**30)


@pytest.mark.parametrize(
    "malform,expected",
    [
        (lying(lambda h, t: h[t[0]].update(data_offsets=h[t[0]]["data_offsets"][::-1])), "malformed safetensors file (Error while deserializing header: invalid offset"),
        (lying(lambda h, t: h.update({t[1]: h[t[0]]})), "invalid offset for tensor"),
        (lying(lambda h, t: h[t[0]].update(data_offsets=[0, 10**6])), "truncated: "),
        (lying(lambda h, t: h[t[0]].update(shape=[3])), "invalid shape, data type, or offset"),
        (lying(lambda h, t: h[t[0]].update(dtype="X99")), "unknown variant `X99`"),
        (lying(lambda h, t: h[t[0]].update(shape=[2**40, 2**40])), "overflow computing buffer size"),
        (lying(lambda h, t: h[t[0]].update(data_offsets=["INF", "INF"])), "offsets aren't integers"),
        (lying(lambda h, t: h["transformer.wte.weight"].update(dtype="I32")), "isn't floating for the model's floating weights (transformer.wte.weight (I32))"),
        (claiming_ten_gigabytes, "a header of 10737418232 bytes, above the format's limit of 100000000"),
    ],
    ids=["begin>end", "overlap", "end>size", "bytes!=numel", "dtype", "huge-shape", "infinity", "I32-for-F32", "10GB"],
)  # fmt: skip
def test_a_safetensors_header_that_lies_is_refused(trainer_checkpoint, tmp_path, malform, expected):
    path, data = trainer_checkpoint
    bad, _ = poisoned_copy(path, tmp_path / "ckpt")
    malform(bad / "model.safetensors")
    assert_library_refuses(lambda: read_checkpoint(bad), str(bad), expected)
    out = tmp_path / "r.json"
    assert_cli_refuses(["nds", bad, "--data", data, "--out", out], str(bad), expected, out=out)


@pytest.mark.parametrize(
    "change,expected",
    [({"n_embd": 60000}, "describes a GPT2LMHeadModel of 43,204,380,000 parameters (173 GB as float32), but the weights hold 4,240 values"),
     ({"n_layer": 10**6}, "describes 1000000 layers, but the weights hold 16 tensors")],
    ids=["n_embd=60000", "n_layer=1e6"],
)  # fmt: skip
def test_a_config_far_larger_than_its_weights_is_refused_before_building(
    trainer_checkpoint, tmp_path, change, expected
):
    """nanoGPT's probe in a Trainer directory: transformers allocated the model before any shape was compared."""
    path, data = trainer_checkpoint
    bad, _ = poisoned_copy(path, tmp_path / "ckpt")
    (bad / "config.json").write_text(json.dumps({**json.loads((bad / "config.json").read_text()), **change}))
    out = tmp_path / "r.json"
    assert_cli_refuses(["nds", bad, "--data", data, "--out", out], f"{bad}/config.json: {expected}", out=out)


def test_a_state_dict_of_integers_for_float_weights_is_refused(trainer_checkpoint, tmp_path):
    path, data = trainer_checkpoint
    weights = load_file(path / "model.safetensors")
    torch.save(
        {**weights, "transformer.wte.weight": weights["transformer.wte.weight"].view(torch.int32)}, tmp_path / "w.pt"
    )
    args = ["nds", tmp_path / "w.pt", "--data", data, "--config", path, "--optimizer", "adamw", "--batch-size", "4"]
    assert_cli_refuses(args, "transformer.wte.weight (torch.int32)", "isn't floating")


@pytest.mark.parametrize(
    "file,content,expected",
    [
        ("trainer_state.json", {"global_step": float("inf")}, "its global_step inf is not a step count"),
        ("trainer_state.json", [1], "not the Trainer's state (a JSON object) but a list"),
        ("trainer_state.json", None, "not the Trainer's state (a JSON object) but null"),
        ("trainer_state.json", "[" * 10**5 + "]" * 10**5, "unreadable (RecursionError)"),
        ("config.json", {"architectures": [123]}, "model class [123] isn't in this transformers"),
        ("config.json", {"architectures": ["__class__"]}, "model class ['__class__'] isn't in this transformers"),
        ("config.json", {"architectures": {"a": 1}}, "its architectures {'a': 1} is not a list of class names"),
    ],
    ids=["1e999", "list", "null", "deep", "[123]", "__class__", "object"],
)  # fmt: skip
def test_json_of_the_wrong_kind_is_refused(trainer_checkpoint, tmp_path, file, content, expected):
    """In a checkpoint directory, and (a config.json) as --config beside a state dict."""
    path, data = trainer_checkpoint
    bad, _ = poisoned_copy(path, tmp_path / "ckpt")
    if isinstance(content, dict) and file == "config.json":
        content = {**json.loads((bad / file).read_text()), **content}
    (bad / file).write_text(content if isinstance(content, str) else json.dumps(content))  # (inf as 1e999 would)
    out = tmp_path / "r.json"
    assert_cli_refuses(["nds", bad, "--data", data, "--out", out], f"{bad}/{file}: {expected}", out=out)
    if file == "config.json":
        torch.save(load_file(path / "model.safetensors"), tmp_path / "w.pt")
        options = ["--config", bad, "--optimizer", "adamw", "--batch-size", "4", "--out", out]
        assert_cli_refuses(["nds", tmp_path / "w.pt", "--data", data, *options], f"--config {bad}/{file}: {expected}")


def test_a_refused_config_is_one_line_in_a_fresh_process(trainer_checkpoint, tmp_path):
    """transformers warns once a process about a config (its token ids outside the vocabulary): a fresh one
    shows those warnings, which came before the --config's error line."""
    path, data = trainer_checkpoint
    bad, _ = poisoned_copy(path, tmp_path / "ckpt")
    (bad / "config.json").write_text(
        json.dumps({**json.loads((bad / "config.json").read_text()), "architectures": [123]})
    )
    torch.save(load_file(path / "model.safetensors"), tmp_path / "w.pt")
    args = ["nds", tmp_path / "w.pt", "--data", data, "--config", bad, "--optimizer", "adamw", "--batch-size", "4"]
    assert "model class [123] isn't in this transformers" in fresh_cli_refuses(args, tmp_path)


def torch_file_of(pickled: bytes, path: Path) -> Path:
    """A ``torch.save`` zip archive at ``path`` whose ``data.pkl`` is ``pickled``."""
    buffer = io.BytesIO()
    torch.save({}, buffer)
    with zipfile.ZipFile(buffer) as real, zipfile.ZipFile(path, "w") as archive:
        for info in real.infolist():
            archive.writestr(info, pickled if info.filename.endswith("/data.pkl") else real.read(info))
    return path


def test_a_pickle_that_broke_the_opcode_walker_is_refused_in_one_line(pcfg_data, tmp_path):
    """STACK_GLOBAL reaching below a mark: the walker took the mark for an object (a TypeError)."""
    bad = torch_file_of(b"\x80\x02(cposix\nsystem\n\x93.", tmp_path / "ckpt.pt")
    assert_library_refuses(lambda: read_checkpoint(bad), f"{bad}: the checkpoint names posix.system", REFUSED)
    assert_cli_refuses(["nds", bad, "--data", pcfg_data], "names posix.system", REFUSED)


def test_the_opcode_walker_does_work_linear_in_the_pickle(pcfg_data, tmp_path):
    """``{'a': ((([m.f0, m.f1, ...],),)...)}``: many globals in a list inside many tuples; the walker copied
    the set of every global named below an object once per tuple (minutes for a megabyte)."""
    moved = {}
    for scale in (1, 4):
        names = b"".join(f"cm\nf{i}\n".encode() for i in range(1000 * scale))
        pickled = b"\x80\x02}X\x01\x00\x00\x00a(" + names + b"l" + b"\x85" * (20_000 * scale) + b"s."
        bad = torch_file_of(pickled, tmp_path / f"ckpt{scale}.pt")
        assert_cli_refuses(["nds", bad, "--data", pcfg_data], "names m.f0", "it is in 'a'")
        entry, moved[scale] = _walk(pickled, "m.f0")
        opcodes = sum(1 for _ in pickletools.genops(pickled))
        assert entry == "a" and moved[scale] <= 4 * opcodes, (moved, opcodes)  # (each entry pushed once, popped once)
    assert moved[4] <= 4 * moved[1]


@pytest.mark.parametrize(
    "model_args,expected",
    [({"n_embd": 60000}, "describe 86,406,480,000 parameters (346 GB as float32), but the weights hold"),
     ({"n_layer": 100_000}, "describe 328,001,312 parameters"), ({"n_embd": float("inf")}, "n_embd inf is not a positive integer")],
    ids=["n_embd=60000", "n_layer=1e5", "infinite"],
)  # fmt: skip
def test_nanogpt_model_args_far_larger_than_the_weights_are_refused(pcfg_data, tmp_path, model_args, expected):
    """model_args that describe a model far larger than the weights: refused with the estimate before any of it
    is allocated (it was 12 GB and a traceback, for n_embd=60000)."""
    _, _, payload = nanogpt_checkpoint(tmp_path)
    bad, out = tmp_path / "big.pt", tmp_path / "r.json"
    torch.save({**payload, "model_args": {**payload["model_args"], **model_args}}, bad)
    assert_library_refuses(lambda: load_nanogpt(read_checkpoint(bad).payload), expected)
    assert_cli_refuses(["nds", bad, "--data", pcfg_data, "--out", out], expected, out=out)


COUNTERS = [(None, "iter_num", math.inf), ("config", "batch_size", 1e30), ("config", "gradient_accumulation_steps", 0)]


@pytest.mark.parametrize("where,key,value", COUNTERS)
def test_nanogpt_counters_that_are_no_integers_are_refused(pcfg_data, tmp_path, where, key, value):
    """nanoGPT's step and batch sizes come from anyone's file: inf was an OverflowError traceback."""
    _, _, payload = nanogpt_checkpoint(tmp_path)
    record = payload if where is None else {**payload[where]}
    record[key] = value
    bad, out = tmp_path / "counted.pt", tmp_path / "r.json"
    torch.save(payload if where is None else {**payload, where: record}, bad)
    assert_cli_refuses(["nds", bad, "--data", pcfg_data, "--out", out], f"nanoGPT's {key} {value!r}", out=out)
