"""tensorwire.ps — see ../shared/DESIGN.md; not built yet."""

__all__ = ()
