"""The DeepSeek-V4 line: compressed sparse attention inside a hybrid cache.

Built from the arena's parts (`engine/arena`): every V4 cache is an arena kind at its natural
page size (see `sizing.py`); the CSA compressed rows are not tiered to the host yet.
"""
