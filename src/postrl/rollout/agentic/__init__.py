"""Multi-turn episodes: environments, tools, and token-exact trajectories for any chat template.

``chat``: the chat template's delta for new messages, checked against the full rendering;
``template_check``: probe conversations that say whether a template is append-only;
``tools`` and ``builtin_tools``: tools from Python functions, tool-call parsing, execution;
``env``: the environment protocol and its registry; ``episodes``: running many episodes through
a rollout engine, turn by turn, into trajectories the trainer scores token for token.
"""
