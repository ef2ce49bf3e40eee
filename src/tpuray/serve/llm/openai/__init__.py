"""The OpenAI API as tpuray serves it: the request models (`protocol`), every check tpuray applies on top
of an engine's own protocol (`checks`), errors in OpenAI's shape (`errors`), logprobs objects
(`logprobs`) and the OpenAPI document (`openapi`). Importing it imports neither an engine nor Ray.
"""
