"""`dflash doctor`: can this machine run this pair, and if not, what to change.

Every check reads files and asks torch about the device; no weights are loaded and nothing is
downloaded or converted, so it answers in a second or two. Each ``Check`` carries a status, a
one-line message and, when something is off, the fix. A failed check also carries the exit code
the same problem gets elsewhere (3 not found, 4 unusable files, 5 incompatible pair, 6 memory,
2 configuration).

The checks are in ``checks`` (software, device, dtype, pair, chat template, speed), the memory
estimate in ``memory``, locating the pair's folders in ``locate``, the report's lines in ``report``;
``run.run_doctor`` runs them in report order.
"""
