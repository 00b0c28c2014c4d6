"""Running a class: a JupyterHub per GPU server, labs handed out and collected, feedback, a gradebook.

- ``roster``: the class list (``--users FILE``), one CSV shared by every step;
- ``exchange``: ``labs release --to``, ``labs collect``, ``labs return`` through
  one folder per student (deadline, late work kept and flagged, every version kept);
- ``feedback``: a student's grade report as a standalone HTML page;
- ``gradebook``: CSVs that Canvas and Moodle import, and the generic one;
- ``hub``: a JupyterHub configuration with a GPU (or MIG slice) per student;
- ``nbgrader_export``: a lab in nbgrader's source format;
- ``cli``: ``python -m llmsys classroom ...`` and the ``labs`` steps above.
"""
