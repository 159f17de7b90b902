"""The README's OpenAI compatibility table as executable cases (:mod:`.cases`)."""
