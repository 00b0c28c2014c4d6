"""The course machinery: the chapter runner, the lab generator and the grader.

Chapter code lives beside this package in ``llmsys``; this package imports what it
runs, and nothing in the shared core or the chapters imports it.
"""
