"""What a run learns from and starts from: the user's prompts (`dataset`), the built-in synthetic tasks
(`synthetic`), the tiny model the project builds itself (`tiny`) and the initial model a run starts from,
warm-started when asked (`initial_model`).
"""
