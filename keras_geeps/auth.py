"""CURVE authentication and encryption for shard links (ZeroMQ's ZAP).

Off by default (loopback); required across machines. `keras-geeps keygen`
writes key pairs in ZeroMQ's certificate format. A shard started with its
secret key and a folder of allowed client public keys accepts only those
clients, through ZeroMQ's ZAP authenticator; all traffic is then encrypted.
A client without a key, or with one not in the folder, never completes the
handshake: it reads nothing, and its first request times out with an error
that names the likely cause.
"""

import hmac
import os
import re
import shutil
import stat
import tempfile

import zmq
import zmq.auth
import zmq.utils.z85
from zmq.auth.thread import ThreadAuthenticator


def require_curve():
    """Raises RuntimeError unless this libzmq supports CURVE."""
    if not zmq.has("curve"):
        raise RuntimeError("this libzmq was built without CURVE support; "
                           "install pyzmq's wheels (they bundle libsodium)")


# A key pair's name: a file name stem, never a path.
_KEY_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")


def check_key_name(name):
    """Raises ValueError unless `name` can name a key pair: 1-100 letters,
    digits, "_", "." or "-", not starting with "." or "-" (so never a path
    or a hidden file)."""
    if not isinstance(name, str) or not _KEY_NAME.match(name):
        raise ValueError(f"key name {name!r} must be 1-100 letters, digits, "
                         f"'_', '.' or '-', starting with a letter or digit")


def pair_paths(directory, name):
    """[public, secret] paths of key pair `name` in `directory`."""
    return [os.path.join(directory, f"{name}.key{suffix}")
            for suffix in ("", "_secret")]


def check_key_folder(directory):
    """Raises ValueError if others may replace the files `directory` will
    hold: a folder on its path (or a link there), as given or resolved,
    that another user owns (not root), or that its group or everyone may
    write to with no sticky bit (which /tmp has). A public key there could
    be swapped for theirs before it is copied to the peers (as OpenSSH's
    StrictModes checks a key's folders)."""
    for path in _ancestors(os.path.abspath(directory)) + _ancestors(
            os.path.realpath(directory)):
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            continue  # (created private)
        if info.st_uid not in (os.getuid(), 0):
            raise ValueError(f"{path} belongs to another user (uid "
                             f"{info.st_uid}), who could replace the keys "
                             f"written in {directory}: use a folder of "
                             f"your own")
        mode = info.st_mode
        if not stat.S_ISLNK(mode) and mode & 0o022 and \
                not mode & stat.S_ISVTX:
            raise ValueError(f"{path} may be written by others (mode "
                             f"{oct(mode & 0o7777)}, no sticky bit), who "
                             f"could replace the keys written in "
                             f"{directory}: use a private folder, or chmod "
                             f"go-w it")


def _ancestors(path):
    """`path` and every folder above it, up to /."""
    paths = [path]
    while os.path.dirname(paths[-1]) != paths[-1]:
        paths.append(os.path.dirname(paths[-1]))
    return paths


def keygen(directory, name, overwrite=False):
    """Writes `<name>.key` (public) and `<name>.key_secret` into `directory`.

    The secret file is readable by its owner only from the moment it
    exists (and a new `directory` is private too).

    Args:
        directory: where to write (created if missing).
        name: the key pair's name, e.g. "shard" or "worker0".
        overwrite: replace an existing pair of that name. Defaults to
            False: refused, since every peer holding the old public key
            would stop working.

    Returns:
        (public_key_path, secret_key_path).

    Raises:
        FileExistsError: the pair exists and `overwrite` is False.
        ValueError: a `name` that is not a plain file name stem
            (`check_key_name`), or a `directory` others may write to
            (`check_key_folder`).

    Example:

    >>> import tempfile
    >>> folder = tempfile.mkdtemp()
    >>> public, secret = keygen(folder, "worker0")
    >>> oct(os.stat(secret).st_mode & 0o777)
    '0o600'
    """
    require_curve()
    check_key_name(name)
    check_key_folder(directory)
    os.makedirs(directory, mode=0o700, exist_ok=True)
    existing = [p for p in pair_paths(directory, name)
                if os.path.exists(p)]
    if existing and not overwrite:
        raise FileExistsError(f"{existing[0]} exists: keep it (peers hold "
                              f"its public key) or pass overwrite=True "
                              f"(keras-geeps keygen --force)")
    # Written in a private folder beside and renamed into place: an old
    # pair (readable by others, or a link elsewhere) is replaced, never
    # written into, and the secret is never readable by others.
    staging = tempfile.mkdtemp(prefix=f".{name}.", dir=directory)
    try:
        previous = os.umask(0o077)
        try:
            written = zmq.auth.create_certificates(staging, name)
        finally:
            os.umask(previous)
        os.chmod(written[0], 0o644)  # public keys are for sharing
        paths = pair_paths(directory, name)
        # The secret first: interrupted between the two, the old public
        # key beside the new secret is refused by name (`load_keypair`),
        # and the peers holding the old public key still match the file.
        for source, target in reversed(list(zip(written, paths))):
            os.replace(source, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return tuple(paths)


def load_keypair(path):
    """Loads (public, secret) from a `.key_secret` (or `.key`) file.

    Args:
        path: the key file; a `.key` file gives a secret of None.

    Returns:
        (public, secret) as bytes (Z85-encoded).

    Raises:
        FileNotFoundError: no such file.
        ValueError: naming the file: it is a folder, holds no CURVE key
            or a malformed one (each must be 40 Z85 characters, on its
            own `public-key = "..."` / `secret-key = "..."` line), holds
            a secret others may read, or a public key that is not its
            secret's.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        raise ValueError(f"{path} is a folder, not a CURVE key file "
                         f"(`keras-geeps keygen` writes them into one)")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"CURVE key file {path} does not exist "
                                f"(`keras-geeps keygen` writes them)")
    try:
        keys = _read_key_lines(path)
    except ValueError as exc:
        raise ValueError(f"{path} is not a CURVE key file "
                         f"(`keras-geeps keygen` writes them): {exc}") \
            from None
    public, secret = keys.get("public-key"), keys.get("secret-key")
    if public is None:
        raise ValueError(f"{path} is not a CURVE key file (`keras-geeps "
                         f"keygen` writes them): it holds no public-key "
                         f"line")
    if secret is not None:
        mode = os.stat(path).st_mode & 0o777
        if mode & 0o077:
            raise ValueError(f"{path} holds a secret key but others may "
                             f"read it (mode {oct(mode)}): chmod 600 it")
        if zmq.curve_public(secret) != public:
            raise ValueError(f"{path}: its public key is not the one of "
                             f"its secret key: make the pair again")
        _check_sibling(path, public)
    return public, secret


def _check_sibling(path, public):
    """Raises ValueError where the `.key` beside secret file `path` holds
    another public key (the copy peers are given would not match: e.g. a
    `keygen --force` interrupted between its two renames)."""
    if not path.endswith(".key_secret"):
        return
    sibling = path[:-len("_secret")]
    try:
        theirs = _read_key_lines(sibling).get("public-key")
    except (OSError, ValueError):
        return  # none there (or not ours to judge): the secret stands
    if theirs is not None and theirs != public:
        raise ValueError(f"{sibling} holds another public key than "
                         f"{path} (a pair mixed up, e.g. by an interrupted "
                         f"`keygen --force`): make the pair again")


_KEY_LINE = re.compile(r'^\s*(public-key|secret-key)\s*=\s*"(.*)"\s*$')
_Z85 = frozenset(zmq.utils.z85.Z85CHARS)


def _read_key_lines(path):
    """{"public-key": z85 bytes, "secret-key": ...} of a ZeroMQ certificate,
    each 40 Z85 characters that decode to 32 bytes, each at most once.

    Raises:
        ValueError: naming what is wrong.
    """
    with open(path, "rb") as f:
        raw = f.read((1 << 16) + 1)
    if len(raw) > 1 << 16:
        raise ValueError("larger than 64 KiB")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("not UTF-8 text") from None
    keys = {}
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith(("public-key", "secret-key")):
            match = _KEY_LINE.match(line)
            if match is None:
                raise ValueError(f"line {number} is not "
                                 f'`<public|secret>-key = "<40 Z85>"`')
            name, value = match.groups()
            if name in keys:
                raise ValueError(f"line {number}: a second {name}")
            keys[name] = _z85_key(value.encode("ascii", "replace"), name,
                                  number)
    return keys


def _z85_key(value, name, number):
    """`value` if it is a CURVE key in Z85 (40 characters, 32 bytes)."""
    if len(value) != 40 or not set(value) <= _Z85:
        raise ValueError(f"line {number}: the {name} is not 40 Z85 "
                         f"characters")
    try:
        decoded = zmq.utils.z85.decode(value)
    except Exception:  # (KeyError, struct.error on out-of-range groups)
        decoded = None
    if decoded is None or len(decoded) != 32:
        raise ValueError(f"line {number}: the {name} does not decode to "
                         f"32 bytes")
    return value


_BOUND_KEY = re.compile(r"^worker(\d+)\.key$")


def key_owners(allowed_clients_dir):
    """{z85 public key: worker id} for the allowed keys named
    `worker<N>.key`: such a key may say HELLO as worker N only. Keys
    named otherwise may speak for any worker.

    Args:
        allowed_clients_dir: the shard's allowed clients folder.

    Returns:
        dict (str -> int).
    """
    owners = {}
    for name in sorted(os.listdir(allowed_clients_dir)):
        match = _BOUND_KEY.match(name)
        if match:
            public, _ = load_keypair(os.path.join(allowed_clients_dir, name))
            owners[public.decode("ascii")] = int(match.group(1))
    return owners


# The ZAP domain of shards' sealed data sockets (`keras_geeps.seal`).
DATA_ZAP_DOMAIN = "keras-geeps-data"


class _ShardAuthenticator(ThreadAuthenticator):
    """pyzmq's ZAP thread, with one-use tokens on the data socket.

    PLAIN sends its password in the clear, so the token a WELCOME (over
    CURVE) gave for a sealed session is seen on the wire by the time it
    is used. Each token therefore admits one connection: the first that
    names its session and presents it, the worker's own. A copy seen on
    the wire is already spent; the worker's own reconnect after a broken
    connection is refused too, and the worker starts a new session
    (HELLO), as it does when messages were lost. Checked in constant
    time; a wrong token spends nothing.
    """

    def _authenticate_plain(self, domain, username, password):
        if domain != DATA_ZAP_DOMAIN:
            return super()._authenticate_plain(domain, username, password)
        tokens = self.passwords.get(domain, {})
        token = tokens.get(username)
        if token is None:
            return False, b"no such session (or its token was used)"
        if not hmac.compare_digest(token.encode(), password.encode()):
            return False, b"wrong session token"
        if tokens.pop(username, None) is None:  # ended meanwhile
            return False, b"no such session"
        return True, b"OK"


class ShardAuth:
    """Makes a shard's ROUTER socket a CURVE server for allowed clients.

    Args:
        context: the shard's zmq.Context.
        secret_key_file: the shard's `.key_secret` file.
        allowed_clients_dir: folder of the clients' public `.key` files.
    """

    def __init__(self, context, secret_key_file, allowed_clients_dir):
        require_curve()
        public, secret = load_keypair(secret_key_file)
        if secret is None:
            raise ValueError(f"{secret_key_file} holds no secret key")
        if not os.path.isdir(allowed_clients_dir):
            raise ValueError(f"allowed clients folder {allowed_clients_dir} "
                             f"does not exist")
        mode = os.stat(allowed_clients_dir).st_mode & 0o777
        if mode & 0o022:
            raise ValueError(f"allowed clients folder {allowed_clients_dir} "
                             f"may be written by others (mode {oct(mode)}), "
                             f"who could add their key: chmod go-w it")
        # pyzmq loads every `*.key` there, and on one it cannot read only
        # logs, allowing nobody: a shard that would refuse every client
        # stops here instead, naming the file.
        names = sorted(n for n in os.listdir(allowed_clients_dir)
                       if n.endswith(".key"))
        if not names:
            raise ValueError(f"allowed clients folder {allowed_clients_dir} "
                             f"holds no .key file: the shard would refuse "
                             f"every client")
        for name in names:
            load_keypair(os.path.join(allowed_clients_dir, name))
        self.public, self.secret = public, secret
        self.key_owners = key_owners(allowed_clients_dir)
        self.authenticator = _ShardAuthenticator(context)
        self.authenticator.start()
        self.authenticator.configure_curve(domain="*",
                                           location=allowed_clients_dir)

    def owner_of(self, user_id):
        """The worker id an allowed key is bound to, or None (any worker).

        Args:
            user_id: the ZAP User-Id of a CURVE connection (the z85 public
                key, what `zmq.Frame.get("User-Id")` gives).
        """
        return self.key_owners.get(user_id)

    def apply(self, socket):
        """Configures `socket` (before bind) as a CURVE server."""
        socket.curve_secretkey = self.secret
        socket.curve_publickey = self.public
        socket.curve_server = True

    def apply_session_check(self, socket, tokens):
        """Configures `socket` (before bind) to take only connections that
        name a live session and its token (ZAP, PLAIN mechanism): the
        sealed data socket, so that nobody without a session gets anything
        buffered there. A token admits one connection (`_ShardAuthenticator`).

        Args:
            socket: the data ROUTER socket.
            tokens: a dict {session id (hex): token (hex)} the caller keeps
                current; the ZAP thread reads it at each connection and
                removes a token once it admitted one.
        """
        self.authenticator.passwords[DATA_ZAP_DOMAIN] = tokens
        socket.zap_domain = DATA_ZAP_DOMAIN.encode()
        socket.plain_server = True

    def stop(self):
        self.authenticator.stop()


class ClientKeys:
    """A worker's CURVE keys and the shards' public key(s).

    Args:
        keypair_file: the worker's `.key_secret` file.
        server_public_key_files: one shard public `.key` file for all
            shards, or a list with one per shard.

    Example:

    ```python
    keys = ClientKeys("keys/worker.key_secret", "keys/shard.key")
    client = GeePSClient(spec, curve=keys)
    ```
    """

    def __init__(self, keypair_file, server_public_key_files):
        require_curve()
        self.public, self.secret = load_keypair(keypair_file)
        if self.secret is None:
            raise ValueError(f"{keypair_file} holds no secret key")
        files = ([server_public_key_files]
                 if isinstance(server_public_key_files, (str, os.PathLike))
                 else list(server_public_key_files))
        self.server_keys = [load_keypair(f)[0] for f in files]

    def apply(self, socket, shard):
        """Makes `socket` a CURVE client of `shard` (before it connects)."""
        socket.curve_secretkey = self.secret
        socket.curve_publickey = self.public
        socket.curve_serverkey = self.server_keys[
            shard if len(self.server_keys) > 1 else 0]
