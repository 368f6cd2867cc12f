"""Client proxy: sessions, programs, lowering, dispatch, futures and buffer ownership."""
