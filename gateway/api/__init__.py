"""The OpenAI API as the gateway speaks it: request schemas, the Responses API, batched prompts, the engines'
fields cleaned from answers, errors in OpenAI's shape, and the replies that carry answers back."""
