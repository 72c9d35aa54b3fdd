"""The options every loader takes, carried as one object: :class:`LoaderOptions` is what :func:`mesh_dataloader`
hands to the array, map-style and streaming loaders and what :class:`~meshwise.data.sampler.CursorLoader` checks,
so that each option is written (and checked) once."""

from __future__ import annotations

import dataclasses
import multiprocessing
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from meshwise.errors import DataError

if TYPE_CHECKING:  # annotations only
    from meshwise.topology import Topology

__all__ = ["LoaderOptions"]


@dataclasses.dataclass(frozen=True)
class LoaderOptions:
    """The keyword options of :func:`meshwise.data.mesh_dataloader` and of the loaders it builds.

    ``global_batch_size`` samples a step over all data ranks; ``mode`` ``"train"`` or ``"eval"``; ``seed`` and
    ``drop_last`` of the sampler; ``parts`` maps a field to its part over the split dims (or is a model stating
    its ``input_parts``); ``read`` who reads in a replica group; ``num_workers``, ``prefetch_factor`` and
    ``multiprocessing_context`` of the reading workers; ``collate_fn`` joins samples (map-style and streams);
    ``stage_fields`` the fields each pipeline stage reads (arrays).
    """

    global_batch_size: int
    mode: str = "train"
    seed: int = 0
    drop_last: bool = True
    parts: Any = None
    read: str = "each"
    num_workers: int = 0
    prefetch_factor: int | None = None
    multiprocessing_context: Any = None
    collate_fn: Callable[[list[Any]], Any] | None = None
    stage_fields: Mapping[str, Sequence[str]] | None = None

    @classmethod
    def of(cls, options: LoaderOptions | None, keywords: Mapping[str, Any], loader: str) -> LoaderOptions:
        """``options``, or the options ``keywords`` name (a loader's keyword arguments); unknown ones raise."""
        if options is not None:
            if keywords:
                raise DataError(f"{loader} takes options= or keyword options, not both (got {sorted(keywords)})")
            return options
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(keywords) - known)
        if unknown:
            raise DataError(f"{loader} takes no option(s) {unknown}: its options are {sorted(known)}")
        if "global_batch_size" not in keywords:
            raise DataError(f"{loader} needs global_batch_size=")
        return cls(**keywords)

    def check_workers(self) -> None:
        """Refuse a ``num_workers`` that is not an int >= 0."""
        n = self.num_workers
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise DataError(f"num_workers must be an int >= 0, got {n!r}")

    def worker_context(self) -> Any:
        """The workers' multiprocessing context: the given one, else ``"fork"`` where the platform has it.

        Workers read through handles they reopen, so fork is safe; it is also fast, where an inherited
        forkserver/spawn default would start each worker from scratch (seconds a worker).
        """
        if self.multiprocessing_context is None and "fork" in multiprocessing.get_all_start_methods():
            return "fork"
        return self.multiprocessing_context


class OptionsLoader:
    """The constructor of the three loaders: a dataset, a topology, and :class:`LoaderOptions` given whole
    (``options=``, as :func:`~meshwise.data.mesh_dataloader` passes them) or as keyword arguments."""

    def __init__(
        self,
        dataset: Any,
        topology: Topology | None = None,
        *,
        options: LoaderOptions | None = None,
        **keywords: Any,
    ) -> None:
        """``options``, or the same as keyword arguments (see :class:`LoaderOptions`); not both."""
        self._build(dataset, topology, LoaderOptions.of(options, keywords, type(self).__name__))

    def _build(self, dataset: Any, topology: Topology | None, options: LoaderOptions) -> None:
        raise NotImplementedError  # each loader reads its kind of source
