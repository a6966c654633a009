"""Agent functions for ``rollout.agent``: code written against the ``openai`` client that rlfunc trains as it is."""
