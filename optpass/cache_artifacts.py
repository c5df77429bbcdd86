"""optpass's files beside Inductor's cache travel in torch's portable cache artifacts.

A step graph that Inductor's FX-graph cache serves calls the updates optpass outlined by key, and
their graphs live as files in Inductor's cache directory (``optpass_updates/``), as does the record
of what the passes did (``optpass_pipeline/``). ``torch.compiler.save_cache_artifacts()`` packs
Inductor's and AOTAutograd's entries for a job that moves to another machine; without optpass's
files there, the resumed job's first step failed ("the update graph ... is neither in this process
nor at ..."). Each such file is recorded as an artifact of type ``optpass_file`` (its path under
the cache directory, its bytes) when it is written or read, and ``load_cache_artifacts`` writes it
back under the new machine's cache directory. ``optpass`` must be imported before
``load_cache_artifacts`` (torch skips a blob with an artifact type it does not know).
"""

from __future__ import annotations

import os

from torch._inductor.runtime.cache_dir_utils import cache_dir

try:        # torch's mega-cache (torch.compiler.save_cache_artifacts); private, so optional
    from torch.compiler._cache import CacheArtifact, CacheArtifactFactory, CacheArtifactManager
except ImportError:           # a torch without it: optpass's files stay on this machine's cache
    CacheArtifact = CacheArtifactFactory = CacheArtifactManager = None

_TYPE = "optpass_file"


class OptpassFileArtifact(CacheArtifact or object):
    """A file under Inductor's cache directory; ``key`` is its path relative to that directory."""

    def populate_cache(self) -> None:
        path = os.path.join(cache_dir(), self.key)
        if os.path.exists(path):
            return
        write_atomically(path, self.content)

    @staticmethod
    def type() -> str:
        return _TYPE


if CacheArtifactFactory is not None and _TYPE not in CacheArtifactFactory._artifact_types:
    CacheArtifactFactory.register(OptpassFileArtifact)      # once per process


def write_atomically(path: str, content: bytes) -> None:
    """Write ``content`` to ``path`` through a temporary name, so no reader sees half a file."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    temporary = f"{path}.{os.getpid()}.{id(content)}.tmp"
    with open(temporary, "wb") as f:
        f.write(content)
    os.replace(temporary, path)


def record(path: str, content: bytes | None = None) -> None:
    """Count the file at ``path`` (under Inductor's cache directory) among the artifacts
    ``save_cache_artifacts`` packs; ``content``: its bytes, if the caller has them."""
    relative = os.path.relpath(path, cache_dir())
    if CacheArtifactManager is None or relative.startswith(".."):
        return
    if content is None:
        try:
            with open(path, "rb") as f:
                content = f.read()
        except OSError:
            return
    CacheArtifactManager.record_artifact(_TYPE, relative, content)
