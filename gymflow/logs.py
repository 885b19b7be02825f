"""The loggers gymflow's tasks write to: a `logging.Logger`, or Prefect's run logger (a
`LoggerAdapter`). A leaf: anything may import it."""

from logging import Logger, LoggerAdapter

AnyLogger = Logger | LoggerAdapter
