import asyncio
from collections.abc import Sequence
from typing import Any

def post_messages(conn: Any, messages: Sequence[Sequence[Any]]) -> asyncio.Future[None] | None: ...
