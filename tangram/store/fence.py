"""The fence of a store's writes: a check run first in every write transaction, which raises ``Deposed`` once another
broker leads the database (``tangram/leadership.py``). A deposed store writes nothing more, so an old leader that has
not yet noticed its loss cannot overwrite what the new one recovered."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from sqlalchemy.ext.asyncio import AsyncConnection


class Deposed(Exception):
    """The fence refused a write: another broker leads this store now."""


#: run first in each write transaction; raises ``Deposed`` when this broker no longer leads
Fence = Callable[[AsyncConnection], Awaitable[None]]
