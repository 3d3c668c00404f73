"""Context parallelism planning: which rank owns which chunks, which key/value rows move where,
and in how many overlapped stages. Pure CPU; the runtime that executes a plan is maskc.runtime."""
