"""Message role codes: the `student_role` array of a conversation store holds one per student token.

The low seven bits are the role of the message whose text (or end-of-turn marker) the token carries,
`ROLE_TEMPLATE` for template text (headers, separators); bit `LAST_ASSISTANT` marks the tokens of a
conversation's final assistant message. Writers (`xtcache.chat`) and readers (stage 2's `--train-on`
masks, `xtcache inspect`) read the codes from here.
"""

ROLE_TEMPLATE, ROLE_SYSTEM, ROLE_USER, ROLE_ASSISTANT, ROLE_TOOL, ROLE_OTHER = 0, 1, 2, 3, 4, 5
LAST_ASSISTANT = 0x80  # bit set on the tokens of the conversation's last assistant message
ROLE_NAMES = {ROLE_TEMPLATE: "template", ROLE_SYSTEM: "system", ROLE_USER: "user", ROLE_ASSISTANT: "assistant",
              ROLE_TOOL: "tool", ROLE_OTHER: "other"}
ROLE_CODES = {"system": ROLE_SYSTEM, "developer": ROLE_SYSTEM, "user": ROLE_USER, "human": ROLE_USER,
               "assistant": ROLE_ASSISTANT, "model": ROLE_ASSISTANT, "gpt": ROLE_ASSISTANT, "tool": ROLE_TOOL,
               "ipython": ROLE_TOOL, "function": ROLE_TOOL}
