"""Built-in offline data of the three tasks: the shop database and its questions
(`shop`), tool definitions and requests (`tool_defs`), constraint prompts (`instructions`)."""
