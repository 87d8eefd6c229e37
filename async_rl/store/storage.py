"""Where run.dir lives: a local (or shared POSIX) directory, or a `gs://` / `s3://` prefix.

Owns: telling the two apart, the path object a module joins names onto (`pathlib.Path` for a
local run directory, `etils.epath.Path` for an object store, which Orbax and Grain take as
they are), and the primitives every module uses on run.dir: reading, listing, atomic
replace, exclusive create, deletion; and, on object stores, the write guard every one of
those writes calls first (the run's lease check). Reading, listing and deleting go through
fsspec's filesystem object on either kind (`locate`); local writes keep the POSIX primitives
(write to a temporary file and rename; O_EXCL); object stores go through fsspec (gcsfs, s3fs;
the optional extras `async_rl[gcs]`, `async_rl[s3]`), where a single PUT is already atomic
and a create is conditional (GCS `ifGenerationMatch=0`, S3 `If-None-Match: *`); and the
tensorstore kvstore that Orbax's arrays go to on s3://. Endpoints and credentials come from
each client's standard environment (STORAGE_EMULATOR_HOST, AWS_ENDPOINT_URL, ...). Does not
own: what the files hold or their names (runfiles), logs (applog), the lease itself (lease),
or how long a call may take and how its failure is named (remote_io).

See docs/design.md, "Run directories on object storage".
"""

from __future__ import annotations

import errno
import functools
import os
import shutil
from pathlib import Path

from async_rl.config import ConfigError
from async_rl.store import remote_io

# scheme -> (the optional extra that brings its client, the module that must import)
BACKENDS = {"gs": ("gcs", "gcsfs"), "s3": ("s3", "s3fs")}


class MissingExtra(ConfigError):
    """An object-store run.dir whose client library is not installed (exit 2)."""


class SymlinkRefused(ConfigError):
    """An entry inside a local run.dir is a symbolic link (exit 2): the run writes only its own
    files, never through a link to a file elsewhere; nothing was changed."""

    def __init__(self, p):
        try:
            target = f" (-> {os.readlink(p)})"
        except OSError:
            target = ""
        super().__init__(f"{p}{target}: is a symbolic link inside run.dir; the run writes, truncates and moves "
                         "its files in place and never through a link: replace it with a real file or folder or "
                         "remove it (nothing was changed)")


def scheme(p) -> str | None:
    """'gs' or 's3' for an object-store URL, None for a local path."""
    s = str(p)
    for name in BACKENDS:
        if s.startswith(f"{name}://"):
            return name
    return None


def is_remote(p) -> bool:
    return scheme(p) is not None


def run_path(p):
    """The path object for a run directory: `Path` (local) or `epath.Path` (object store)."""
    if is_remote(p):
        from etils import epath
        filesystem(p)  # a missing extra is named here, before anything else is tried
        return epath.Path(str(p).rstrip("/"))
    return Path(p)


def url(p) -> str:
    return str(p)


@functools.lru_cache(maxsize=None)
def _fs(name: str, settings: int):
    """One filesystem per scheme and setting of the bound (`remote_io.settings`)."""
    extra, module = BACKENDS[name]
    try:
        __import__(module)
    except ImportError:
        raise MissingExtra(f"{name}:// run directories need the {module} client: pip install 'async_rl[{extra}]'") \
            from None
    import fsspec
    import fsspec.config

    remote_io.ensure()  # every call bounded and named (run.storage_timeout_s)
    # listings are read fresh: another process (or host) may have written since. A config
    # default (applied by every class whose protocols include `name`) reaches the instances
    # Orbax and etils.epath make too, not only ours.
    fsspec.config.conf.setdefault(name, {})["use_listings_cache"] = False
    return fsspec.filesystem(name, skip_instance_cache=True)


def filesystem(p):
    """The fsspec filesystem of an object-store URL (MissingExtra naming the extra to install)."""
    name = scheme(p)
    if name is None:
        raise ValueError(f"{p}: not an object-store URL")
    return _fs(name, remote_io.settings())


def tensorstore_kvstore(p) -> dict:
    """tensorstore's kvstore spec for an `s3://bucket/key` prefix (Orbax writes arrays through
    it). Endpoint and region come from the AWS SDKs' standard settings, as s3fs's client
    reads them: AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL or the profile's `endpoint_url` (its
    `services` section's s3 one first); AWS_REGION, AWS_DEFAULT_REGION or the profile's
    region; where no region is set, tensorstore asks the bucket."""
    if scheme(p) != "s3":
        raise ValueError(f"{p}: not an s3:// URL")
    bucket, _, key = url(p)[len("s3://"):].partition("/")
    spec = {"driver": "s3", "bucket": bucket, "path": key}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or _profile_endpoint()
    if endpoint:
        spec["endpoint"] = endpoint
    region = _aws_region()
    if region:
        spec["aws_region"] = region
    spec["context"] = {"s3_request_retries": remote_io.tensorstore_retries()}  # bounded by run.storage_timeout_s
    if os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY"):
        # the keys the default chain would take first; naming their provider skips its profile
        # lookup, which logs five error lines per checkpoint where there are no profile files
        spec["context"]["aws_credentials"] = {"type": "environment"}
    return spec


def _aws_region() -> str | None:
    return os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or _profile_region()


@functools.lru_cache(maxsize=None)
def _profile_endpoint() -> str | None:
    """The s3 endpoint the AWS config file names for the current profile, None without one."""
    if os.environ.get("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "").lower() == "true":
        return None
    try:
        import botocore.exceptions
        import botocore.session
    except ImportError:
        return None
    session = botocore.session.get_session()
    try:
        scoped = session.get_scoped_config()
    except botocore.exceptions.ProfileNotFound:
        return None
    if str(scoped.get("ignore_configured_endpoint_urls", "")).lower() == "true":
        return None
    service = session.full_config.get("services", {}).get(scoped.get("services", ""), {}).get("s3", {})
    return service.get("endpoint_url") or scoped.get("endpoint_url")


@functools.lru_cache(maxsize=None)
def _profile_region() -> str | None:
    try:
        import botocore.session  # s3fs's client reads the same profile
    except ImportError:
        return None
    return botocore.session.get_session().get_config_variable("region")


# ---- reading ---------------------------------------------------------------------------


def locate(p):
    """(fsspec filesystem, path in it) for `p`: the run's configured client on an object store
    (one instance per scheme, bounded by remote_io), the local filesystem otherwise."""
    if is_remote(p):
        return filesystem(p), url(p)
    import fsspec.core
    return fsspec.core.url_to_fs(os.fspath(p))


def exists(p) -> bool:
    fs, where = locate(p)
    return fs.exists(where)


def is_file(p) -> bool:
    fs, where = locate(p)
    return fs.isfile(where)


def is_dir(p) -> bool:
    fs, where = locate(p)
    return fs.isdir(where)


def size(p) -> int:
    """Bytes in file `p`; FileNotFoundError where there is none."""
    fs, where = locate(p)
    return int(fs.info(where)["size"])


def read_bytes(p) -> bytes:
    fs, where = locate(p)
    return fs.cat_file(where)


def read_text(p) -> str:
    return read_bytes(p).decode()


def listdir(p) -> list[str]:
    """Names directly under folder `p` (files and folders), sorted; [] where there is nothing."""
    fs, where = locate(p)
    try:
        entries = fs.ls(where, detail=False)
    except (FileNotFoundError, NotADirectoryError):
        return []
    # a file lists itself (a local one by its own path): no names under it
    return sorted({e.rstrip("/").rsplit("/", 1)[-1] for e in entries if e.rstrip("/") != where.rstrip("/")} - {""})


def glob(p, pattern: str) -> list:
    """Paths under `p` whose names match `pattern` (one level), sorted."""
    import fnmatch
    return [p / n for n in listdir(p) if fnmatch.fnmatchcase(n, pattern)]


# ---- writing ---------------------------------------------------------------------------

# Writes under an object-store run directory first call its holder's check (the lease:
# LockLostError once it is lost), so a run that lost its lease writes nothing more.
_guards: dict[str, object] = {}


def guard(root, check) -> None:
    """Every write under `root` (an object-store run directory) calls `check()` first."""
    _guards[url(root).rstrip("/") + "/"] = check


def unguard(root) -> None:
    _guards.pop(url(root).rstrip("/") + "/", None)


def check_write(p) -> None:
    """The write guard of the run directory holding `p`, if any (Orbax's commit calls it too)."""
    if _guards:
        u = url(p)
        for root, check in list(_guards.items()):
            if u.startswith(root):
                check()


# Inside a local run directory every entry a write reaches is the run's own: a symbolic link
# (to a file outside it, say) is refused, not followed. The run directory itself and its
# parents may be links (a run kept on another disk); object stores have no links.
SCAN_DEPTH = 3  # levels below run.dir `refuse_links` looks at (checkpoints/<step>/<item>)


def no_link(p) -> None:
    """SymlinkRefused where local path `p` is a symbolic link."""
    if not is_remote(p) and os.path.islink(p):
        raise SymlinkRefused(p)


def refuse_links(root, depth: int = SCAN_DEPTH, opaque: tuple = ()) -> None:
    """SymlinkRefused naming the first symbolic link found within `depth` levels under local
    folder `root` (not `root` itself), before anything in it is written. Folders named in
    `opaque` (directly under `root`) are checked themselves, not looked into: another
    program's own (W&B links its latest run there)."""
    if is_remote(root):
        return
    todo = [(os.fspath(root), depth)]
    while todo:
        folder, left = todo.pop()
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except (FileNotFoundError, NotADirectoryError):
            continue
        for e in entries:
            if e.is_symlink():
                raise SymlinkRefused(Path(e.path))
            if left > 1 and e.is_dir(follow_symlinks=False) and not (left == depth and e.name in opaque):
                todo.append((e.path, left - 1))


def open_no_follow(p, flags: int, mode: int = 0o644) -> int:
    """os.open of a local file that refuses (SymlinkRefused) rather than follows a link at `p`."""
    try:
        return os.open(p, flags | os.O_NOFOLLOW, mode)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EEXIST) and os.path.islink(p):  # EEXIST: O_EXCL
            raise SymlinkRefused(p) from None
        raise


# write_atomic, create and move keep a local directory on os calls: an atomic rename and an
# O_EXCL create are the point there, and fsspec's local filesystem promises neither.


def write_atomic(p, data: bytes | str) -> None:
    """Readers see the old content or the new, never a torn write (OSError as raised)."""
    data = data.encode() if isinstance(data, str) else data
    if is_remote(p):
        check_write(p)
        filesystem(p).pipe_file(url(p), data)  # one PUT: the object appears whole
        return
    p = Path(p)
    no_link(p)
    tmp = p.with_name(f".{p.name}.tmp{os.getpid()}")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, p)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def create(p, data: bytes) -> bool:
    """Writes `p` only if it does not exist yet; False where it does (another writer won).
    Readers (and a process killed meanwhile) see it whole or not at all."""
    if is_remote(p):
        check_write(p)
        try:
            filesystem(p).pipe_file(url(p), data, mode="create")
        except FileExistsError:
            return False
        return True
    p = Path(p)
    no_link(p)
    tmp = p.with_name(f".{p.name}.tmp{os.getpid()}")
    tmp.write_bytes(data)
    try:  # written whole first, then linked in: the link fails where `p` exists
        os.link(tmp, p)
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)
    return True


def remove(p) -> None:
    """Deletes file `p` (nothing where it is gone already)."""
    fs, where = locate(p)
    check_write(p)
    no_link(p)
    try:
        fs.rm_file(where)
    except FileNotFoundError:
        pass


def mkdirs(p) -> None:
    """A directory for `p` (object stores have none: nothing to do)."""
    if not is_remote(p):
        no_link(p)
        fs, where = locate(p)
        fs.makedirs(where, exist_ok=True)


def move(src, dst) -> None:
    """Moves a file or folder (object stores: copy then delete, so not atomic)."""
    if is_remote(src):
        check_write(src)
        filesystem(src).mv(url(src), url(dst), recursive=True)
    else:
        no_link(src)
        no_link(dst)
        os.replace(src, dst)


def remove_tree(p) -> None:
    """Deletes folder `p` and everything under it (nothing where it is gone). A local folder
    that is a link is refused; links inside it are removed, never followed."""
    if not is_remote(p):
        no_link(p)
        shutil.rmtree(p, ignore_errors=True)
        return
    fs = filesystem(p)
    try:
        found = fs.find(url(p))
    except FileNotFoundError:
        return
    if found:
        check_write(p)
        fs.rm([f"{scheme(p)}://{f}" for f in found])
