"""Documents people write, scenarios and plans alike: read within a size limit, screened for hostile YAML, decoded,
and every problem explained in one line naming the file, the ``$.path`` and the fix."""
